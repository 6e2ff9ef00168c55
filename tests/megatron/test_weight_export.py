"""The refit gather: HF tensors -> Megatron shards at TP/PP -> gather_hf_weights gives them back exactly."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank

pytestmark = pytest.mark.multirank

VOCAB = 250  # padded to 256 by Megatron: the padding rows must not come back


def _to_local(canonical: str) -> str:
    return (canonical.replace(".self_attention.linear_qkv.layer_norm_", ".input_layernorm.")
            .replace(".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))


def _roundtrip(rank, world, tp, pp, overrides):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.convert.layout import all_hf_shapes, iter_hf_to_canonical, units
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import load_full_state_dict
    from dpcc_megatron.megatron.weight_export import gather_hf_weights
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

    cfg = tiny_model_config(**overrides)
    served = tiny_model_config(**dict(overrides, vocab_size=VOCAB))
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in all_hf_shapes(served)}
    full = {}
    for u in units(served):
        for name, blocks in iter_hf_to_canonical(served, u, hf.__getitem__):
            full[_to_local(name)] = torch.cat(blocks, 0)
    par = parallel_config(tp, pp)
    init_model_parallel(par, seed=1)
    chunks = [build_gpt_model(cfg, par)]
    load_full_state_dict(chunks, full)
    pairs = gather_hf_weights(chunks, cfg, vocab_size=VOCAB, dtype=torch.float32,
                              tp_group=ps.get_tensor_model_parallel_group(),
                              pp_group=ps.get_pipeline_model_parallel_group())
    if pairs is None:
        return None
    return {"names": [n for n, _ in pairs], "expected": list(hf),
            "gap": max(float((t - hf[n]).abs().max()) for n, t in pairs)}


@pytest.mark.parametrize("tp,pp,overrides", [
    (2, 1, dict(num_layers=2, swiglu=True)),
    (1, 2, dict(num_layers=4, swiglu=True, tie_embeddings=True)),
], ids=["tp2", "pp2-tied"])
def test_gather_returns_the_hf_tensors(tp, pp, overrides):
    results = run_multirank(_roundtrip, tp * pp, args=(tp, pp, overrides), timeout=240)
    assert results[1] is None  # only the model-parallel group's rank 0 holds the gathered weights
    r = results[0]
    assert r["names"] == r["expected"]  # every tensor, in file order, padded vocabulary rows dropped
    assert r["gap"] == 0.0
