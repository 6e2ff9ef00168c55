"""Tensor layout (QKV grouping, SwiGLU, vocabulary) and the streamed safetensors writer."""
import pytest
import torch

from dpcc_megatron.convert.hf_files import SafetensorsStreamWriter, plan_shards
from dpcc_megatron.convert.layout import (all_hf_shapes, canonical_name, canonical_to_hf, hf_shapes,
                                          iter_hf_to_canonical, qkv_from_mcore, qkv_to_mcore, units)
from dpcc_megatron.convert.tensors import checked_cast, pad_rows
from dpcc_megatron.convert.errors import ConversionError
from dpcc_megatron.testing.tiny import tiny_model_config


def test_qkv_is_grouped_q_heads_then_k_then_v():
    heads, groups, hd, h = 4, 2, 1, 3
    q = torch.arange(heads * hd * h).reshape(heads * hd, h).float()      # rows q0..q3
    k = 100 + torch.arange(groups * hd * h).reshape(groups * hd, h).float()
    v = 200 + torch.arange(groups * hd * h).reshape(groups * hd, h).float()
    qkv = qkv_to_mcore(q, k, v, heads, groups)
    rows = [q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]]  # group 0, then group 1
    torch.testing.assert_close(qkv, torch.stack(rows), rtol=0, atol=0)
    for a, b in zip(qkv_from_mcore(qkv, heads, groups, hd), (q, k, v)):
        assert torch.equal(a, b)


def test_qkv_bias_uses_the_same_grouping():
    q, k, v = torch.randn(8 * 4), torch.randn(2 * 4), torch.randn(2 * 4)
    qkv = qkv_to_mcore(q, k, v, 8, 2)
    assert torch.equal(qkv[:16], q[:16]) and torch.equal(qkv[16:20], k[:4]) and torch.equal(qkv[20:24], v[:4])
    assert all(torch.equal(a, b) for a, b in zip(qkv_from_mcore(qkv, 8, 2, 4), (q, k, v)))


@pytest.mark.parametrize("tied,bias", [(False, False), (True, True)])
def test_layer_mapping_inverts_exactly(tied, bias):
    cfg = tiny_model_config(tie_embeddings=tied, add_qkv_bias=bias, vocab_size=100)
    for unit in units(cfg):
        hf = {n: torch.randn(s) for n, s in hf_shapes(cfg, unit).items()}
        can = {name: torch.cat(blocks) for name, blocks in iter_hf_to_canonical(cfg, unit, hf.__getitem__)}
        if unit == 0:
            assert torch.equal(can["decoder.layers.0.mlp.linear_fc1.weight"],
                               torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]]))
        back = canonical_to_hf(cfg, unit, can)
        assert list(back) == list(hf)
        assert all(torch.equal(back[n], hf[n]) for n in hf)
    names = [n for n, _ in all_hf_shapes(cfg)]
    assert ("lm_head.weight" in names) != tied and len(names) == len(set(names))


def test_local_spec_norm_names_map_to_the_checkpoint_names():
    assert canonical_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_name("decoder.layers.0.pre_mlp_layernorm.weight") == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"


def test_vocab_padding_appends_zero_rows():
    t = torch.randn(100, 4)
    p = pad_rows(t, 128)
    assert p.shape == (128, 4) and torch.equal(p[:100], t) and not p[100:].any()
    with pytest.raises(ConversionError, match="does not fit"):
        pad_rows(t, 64)


def test_checked_cast_refuses_overflow_nan_and_integers():
    assert checked_cast(torch.ones(3), torch.bfloat16, "w").dtype == torch.bfloat16
    with pytest.raises(ConversionError, match=r"w has values up to 1e\+05, which overflow torch.float16"):
        checked_cast(torch.tensor([1.0, 1e5]), torch.float16, "w")
    with pytest.raises(ConversionError, match="NaN or Inf"):
        checked_cast(torch.tensor([1.0, float("nan")]), torch.float32, "w")
    with pytest.raises(ConversionError, match="torch.int8"):
        checked_cast(torch.zeros(3, dtype=torch.int8), torch.float32, "w")


def test_streamed_safetensors_read_back(tmp_path):
    from safetensors import safe_open

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 2).half()}
    w = SafetensorsStreamWriter(tmp_path / "x.safetensors", [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    with pytest.raises(RuntimeError, match="expected a next"):
        w.write("b", tensors["b"])
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(torch.equal(f.get_tensor(n), t) for n, t in tensors.items())


def test_incomplete_safetensors_file_is_reported(tmp_path):
    w = SafetensorsStreamWriter(tmp_path / "x.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (2,))])
    w.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="1 tensors were never written"):
        w.close()


def test_shards_respect_the_size_limit():
    entries = [(f"t{i}", torch.float32, (10,)) for i in range(7)] + [("big", torch.float32, (100,))]
    shards = plan_shards(entries, max_bytes=100)
    assert [len(s) for s in shards] == [2, 2, 2, 1, 1]
    assert [e for s in shards for e in s] == entries
