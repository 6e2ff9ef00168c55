"""NeMo 2 context <-> ModelConfig, against model.yaml/io.json files NeMo 2.7.3 wrote
(tests/fixtures/nemo2): the mapping, every refusal naming its ``config.<field>``, incomplete
checkpoints, and the context we write compared with NeMo's own."""
import json
import re
import shutil

import pytest
import yaml

from dpcc_megatron.config import ModelConfig
from dpcc_megatron.convert import ConversionError
from dpcc_megatron.convert.compat import architecture_diffs
from dpcc_megatron.convert.nemo_format import (io_json, is_nemo2_dir, model_yaml, nemo_config_args,
                                               read_nemo_checkpoint, read_nemo_model_config)

from .hf_models import run_cli
from .nemo_helpers import CONFIGS, LLAMA, config_paths

LLAMA_CFG = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                        kv_channels=16, vocab_size=96, make_vocab_size_divisible_by=128, max_seq_len=64,
                        norm_epsilon=1e-5, rotary_base=500000.0, tie_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def _ckpt(tmp_path, source_yaml, edit=None, weights=True):
    """A NeMo 2 directory whose context/model.yaml is ``source_yaml`` after ``edit(doc)``."""
    root = tmp_path / "ckpt"
    (root / "context").mkdir(parents=True)
    doc = yaml.safe_load(source_yaml.read_text())
    if edit:
        edit(doc)
    (root / "context" / "model.yaml").write_text(yaml.safe_dump(doc))
    if weights:
        shutil.copytree(LLAMA / "weights", root / "weights")
    return root


def test_llama_fixture_maps_to_the_model_config():
    assert is_nemo2_dir(LLAMA)
    assert read_nemo_model_config(LLAMA) == LLAMA_CFG


def test_qwen2_and_mistral_configs(tmp_path):
    qwen = read_nemo_model_config(_ckpt(tmp_path / "q", CONFIGS / "qwen2.yaml", weights=False))
    assert (qwen.add_qkv_bias, qwen.norm_epsilon, qwen.rotary_base, qwen.rope_scaling, qwen.tie_embeddings) == \
        (True, 1e-6, 1000000.0, None, False)
    mistral = read_nemo_model_config(_ckpt(tmp_path / "m", CONFIGS / "mistral.yaml", weights=False))
    assert (mistral.add_qkv_bias, mistral.rotary_base, mistral.rope_scaling, mistral.max_seq_len) == \
        (False, 10000.0, None, 64)

    def windowed(doc):  # Mistral 7B's own setting: a 4096-token left window, longer sequences
        doc["config"].update(window_size=[4096, 0], seq_length=32768)

    assert read_nemo_model_config(_ckpt(tmp_path / "w", CONFIGS / "mistral.yaml", windowed,
                                        weights=False)).max_seq_len == 4096


def _set(**fields):
    return lambda doc: doc["config"].update(fields)


def _drop(field):
    return lambda doc: doc["config"].pop(field)


@pytest.mark.parametrize("edit,needles", [
    (_set(qk_l2_norm=True), ["config.qk_l2_norm is True"]),
    (_set(num_moe_experts=8, moe_shared_expert_intermediate_size=64), ["config.moe_shared_expert_intermediate_size is 64"]),
    (_set(num_moe_experts=8, moe_router_score_function="sigmoid"), ["config.moe_router_score_function is 'sigmoid'"]),
    (_set(num_moe_experts=8, moe_layer_freq=2), ["config.moe_layer_freq is 2"]),
    (_set(num_moe_experts=8, moe_router_load_balancing_type="sinkhorn"),
     ["config.moe_router_load_balancing_type is 'sinkhorn'", "aux_loss, none"]),
    (_set(num_moe_experts=8, moe_router_topk=9), ["config", "moe_router_topk"]),
    (_set(num_moe_experts=8, moe_router_topk_limited_devices=2), ["config.moe_router_topk_limited_devices is 2"]),
    (_set(rotary_percent=0.5), ["config.rotary_percent"]),
    (_set(window_size=[128, 128]), ["config.window_size"]),
    (_set(normalization="LayerNorm1P"), ["config.normalization is 'LayerNorm1P'", "RMSNorm, LayerNorm"]),
    (_set(activation_func={"_call_": False, "_target_": "torch.nn.functional.gelu"}),
     ["config.activation_func", "torch.nn.functional.silu"]),
    (_set(low_freq_factor=2.0), ["config.low_freq_factor is 2"]),
    (_set(position_embedding_type="yarn"), ["config.position_embedding_type is 'yarn'"]),
    (_set(rotary_base=10000.5), ["config.rotary_base"]),
    (_set(num_query_groups=3), ["config", "num_query_groups"]),
    (_drop("hidden_size"), ["config.hidden_size is missing"]),
    (_set(hidden_size="64x"), ["config.hidden_size is '64x'; expected an integer"]),
    (_set(num_layers=2.5), ["config.num_layers is 2.5; expected an integer"]),
    (_set(layernorm_epsilon=None), ["config.layernorm_epsilon is None; expected a number"]),
    (lambda doc: doc.update(_target_="nemo.collections.llm.gpt.model.deepseek.DeepSeekModel"),
     ["DeepSeekModel is not supported", "LlamaModel", "Qwen2Model", "MistralModel", "Qwen3Model", "MixtralModel"]),
    (lambda doc: doc.pop("config"), ["config: no _target_"]),
])
def test_unsupported_or_broken_configs_name_the_field(tmp_path, edit, needles):
    with pytest.raises(ConversionError) as e:
        read_nemo_model_config(_ckpt(tmp_path, LLAMA / "context" / "model.yaml", edit, weights=False))
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_malformed_yaml_and_incomplete_checkpoints(tmp_path):
    bad = tmp_path / "bad"
    (bad / "context").mkdir(parents=True)
    (bad / "context" / "model.yaml").write_text("_target_: [unclosed\n")
    with pytest.raises(ConversionError, match="invalid YAML"):
        read_nemo_model_config(bad)
    no_weights = _ckpt(tmp_path / "nw", LLAMA / "context" / "model.yaml", weights=False)
    with pytest.raises(ConversionError, match="no weights/ directory"):
        read_nemo_checkpoint(no_weights)
    partial = _ckpt(tmp_path / "p", LLAMA / "context" / "model.yaml")
    (partial / "weights" / ".metadata").unlink()
    with pytest.raises(ConversionError, match="has no .metadata"):
        read_nemo_checkpoint(partial)
    (partial / "weights" / "metadata.json").unlink()
    with pytest.raises(ConversionError, match="no metadata.json"):
        read_nemo_checkpoint(partial)


def test_null_vocab_size_is_read_from_the_weights(tmp_path):
    ckpt = _ckpt(tmp_path, LLAMA / "context" / "model.yaml", _set(vocab_size=None))
    with pytest.raises(ConversionError, match="config.vocab_size is null"):
        read_nemo_model_config(ckpt)
    cfg, weights = read_nemo_checkpoint(ckpt)
    assert cfg.vocab_size == 96 and weights == ckpt / "weights"


def test_differences_from_the_job_model_section_are_listed():
    job = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, vocab_size=96,
                      kv_channels=16, rotary_base=500000.0, tie_embeddings=True)
    diffs = architecture_diffs([], read_nemo_model_config(LLAMA), job)
    assert sorted(d.split(":")[0] for d in diffs) == ["ffn_hidden_size", "num_query_groups", "rope_scaling"]
    assert "ffn_hidden_size: checkpoint has 96, the model has 256" in diffs


def test_written_context_matches_nemos_own(tmp_path):
    """model.yaml/io.json written for the fixture's config name NeMo's fields with NeMo's values,
    and io.json has NeMo's object paths and classes (its Llama31Config is the base class of
    the fixture's Llama32Config1B)."""
    ours = yaml.safe_load(model_yaml(LLAMA_CFG))
    theirs = yaml.safe_load((LLAMA / "context" / "model.yaml").read_text())
    assert ours["_target_"] == theirs["_target_"]
    assert ours["config"]["_target_"] == "nemo.collections.llm.gpt.model.llama.Llama31Config"
    for field, value in ours["config"].items():
        if field != "_target_":
            assert field in theirs["config"] and theirs["config"][field] == value, field
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.yaml").write_text(model_yaml(LLAMA_CFG))
    assert read_nemo_model_config(tmp_path) == LLAMA_CFG  # our reader reads what we write

    (tmp_path / "io.json").write_text(io_json(LLAMA_CFG))
    ours_paths = config_paths(tmp_path / "io.json")
    doc = json.loads((tmp_path / "io.json").read_text())
    theirs_paths = config_paths(LLAMA / "context" / "io.json")
    assert ours_paths["<root>.model.config"] == "nemo.collections.llm.gpt.model.llama.Llama31Config"
    assert theirs_paths["<root>.model.config"] == "nemo.collections.llm.gpt.model.llama.Llama32Config1B"
    for path in ("<root>", "<root>.model", "<root>.trainer", "<root>.trainer.strategy", "<root>.extra"):
        assert ours_paths[path] == theirs_paths[path], path
    assert doc["root"] == {"type": "ref", "key": "trainer_context_1"} and doc["version"] == "0.0.1"
    assert set(doc["refcounts"]) == set(doc["objects"])
    leaves = {v["paths"][0]: v["value"] for obj in doc["objects"].values() for _, v in obj.get("items", [])
              if isinstance(v, dict) and v.get("type") == "leaf" and "paths" in v}
    assert leaves["<root>.model.config.vocab_size"] == 96 and leaves["<root>.model.tokenizer"] is None


@pytest.mark.parametrize("change,needle", [
    ({"normalization": "LayerNorm"}, "only RMSNorm + SwiGLU + RoPE"),
    ({"swiglu": False}, "only RMSNorm + SwiGLU + RoPE"),
    ({"add_qkv_bias": True}, "rope scaling is written only for Llama"),
    ({"qk_layernorm": True}, "(NeMo's Llama31Config); this model is written as Qwen3"),
    ({"add_qkv_bias": True, "num_moe_experts": 4, "rope_scaling": None}, "add_qkv_bias with num_moe_experts=4"),
    ({"add_qkv_bias": True, "qk_layernorm": True, "rope_scaling": None}, "add_qkv_bias with qk_layernorm=True"),
])
def test_models_nemo_cannot_express_are_refused(change, needle):
    import dataclasses

    with pytest.raises(ConversionError, match=re.escape(needle)):
        nemo_config_args(dataclasses.replace(LLAMA_CFG, **change))


def test_cli_refuses_a_missing_source(tmp_path):
    rc, out, err = run_cli(["convert", "mcore-to-nemo", "--mcore", str(tmp_path / "absent"),
                            "--out", str(tmp_path / "o")])
    assert rc == 1 and err.startswith("error: ") and "does not exist" in err and "Traceback" not in err


MOE_CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      kv_channels=16, vocab_size=100, max_seq_len=512, norm_epsilon=1e-6, rotary_base=1000000.0,
                      num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=24, moe_aux_loss_coeff=1e-3,
                      moe_z_loss_coeff=1e-4)


@pytest.mark.parametrize("change,config_class", [
    ({"num_moe_experts": None, "moe_ffn_hidden_size": None, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0,
      "qk_layernorm": True, "tie_embeddings": True}, "qwen3.Qwen3Config"),
    ({"qk_layernorm": True}, "qwen3.Qwen3MoEConfig"),
    ({"moe_router_pre_softmax": True, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0,
      "moe_expert_capacity_factor": 1.5}, "mixtral.MixtralConfig"),
])
def test_qwen3_and_moe_contexts_read_back(tmp_path, change, config_class):
    """What we write for Qwen3, Qwen3-MoE and Mixtral reads back as the same model config, the
    router's loss coefficients included; "none" balancing and a null z-loss read as 0."""
    import dataclasses

    cfg = dataclasses.replace(MOE_CFG, **change)
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.yaml").write_text(model_yaml(cfg))
    doc = yaml.safe_load((tmp_path / "context" / "model.yaml").read_text())
    assert doc["config"]["_target_"] == f"nemo.collections.llm.gpt.model.{config_class}"
    assert read_nemo_model_config(tmp_path) == cfg
    if cfg.num_moe_experts:
        want = "aux_loss" if cfg.moe_aux_loss_coeff else "none"
        assert (doc["config"]["moe_router_load_balancing_type"], doc["config"]["moe_z_loss_coeff"]) == \
            (want, cfg.moe_z_loss_coeff or None)


def test_io_json_names_the_tokenizer_and_the_weights_dtype(tmp_path):
    """With a tokenizer, the model's ``tokenizer`` is NeMo's AutoTokenizer of ``nemo_tokenizer``
    (relative to context/, as NeMo's HF importers record it); the precision fields follow the
    weights' dtype as a ``torch`` reference."""
    (tmp_path / "io.json").write_text(io_json(LLAMA_CFG, tokenizer=True, dtype="bf16"))
    paths = config_paths(tmp_path / "io.json")
    assert paths["<root>.model.tokenizer"] == \
        "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer"
    doc = json.loads((tmp_path / "io.json").read_text())
    values = {v["paths"][0]: v for obj in doc["objects"].values() for _, v in obj.get("items", [])
              if isinstance(v, dict) and "paths" in v and v.get("type") != "ref"}
    assert values["<root>.model.tokenizer.pretrained_model_name"]["value"] == "nemo_tokenizer"
    assert values["<root>.model.config.params_dtype"] == {"type": "pyref", "module": "torch", "name": "bfloat16",
                                                          "paths": ["<root>.model.config.params_dtype"]}
    assert (values["<root>.model.config.bf16"]["value"], values["<root>.model.config.fp16"]["value"]) == (True, False)
    tok = yaml.safe_load(model_yaml(LLAMA_CFG, tokenizer=True))["tokenizer"]
    assert tok == {"_target_": "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer",
                   "pretrained_model_name": "nemo_tokenizer"}
    with pytest.raises(ConversionError, match="dtype 'fp8'"):
        io_json(LLAMA_CFG, dtype="fp8")


# NeMo's model.yaml of tiny presets (tests/fixtures/nemo2/make_fixture.py): name -> (config class, the model
# config fields they map to, the dtype NeMo's config builds in)
NEMO_CONFIGS = {
    "qwen3": ("qwen3.Qwen3Config600M", dict(qk_layernorm=True, tie_embeddings=True, norm_epsilon=1e-6,
                                            num_moe_experts=None), "fp32"),
    "qwen3_moe": ("qwen3.Qwen3Config30B_A3B", dict(qk_layernorm=True, tie_embeddings=False, num_moe_experts=8,
                                                   moe_router_topk=2, moe_ffn_hidden_size=24,
                                                   moe_router_pre_softmax=False, moe_aux_loss_coeff=1e-3,
                                                   moe_z_loss_coeff=0.0), "fp32"),
    "mixtral": ("mixtral.MixtralConfig8x7B", dict(qk_layernorm=False, tie_embeddings=False, num_moe_experts=4,
                                                  moe_router_topk=2, moe_ffn_hidden_size=None, norm_epsilon=1e-5,
                                                  moe_aux_loss_coeff=0.01), "bf16"),
}


@pytest.mark.parametrize("name", sorted(NEMO_CONFIGS))
def test_nemos_qwen3_and_moe_configs_map_and_write_back(tmp_path, name):
    """NeMo's own Qwen3, Qwen3-MoE and Mixtral model.yaml map to the model config, and what we write
    for that config names NeMo's fields with NeMo's values (the config class is the family's base)."""
    preset, fields, dtype = NEMO_CONFIGS[name]
    ckpt = _ckpt(tmp_path, CONFIGS / f"{name}.yaml", weights=False)
    theirs = yaml.safe_load((ckpt / "context" / "model.yaml").read_text())
    assert theirs["config"]["_target_"] == f"nemo.collections.llm.gpt.model.{preset}"
    cfg = read_nemo_model_config(ckpt)
    assert {k: getattr(cfg, k) for k in fields} == fields
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels, cfg.vocab_size) == (4, 64, 96, 16, 96)
    ours = yaml.safe_load(model_yaml(cfg, dtype=dtype))
    assert ours["_target_"] == theirs["_target_"]
    assert ours["config"]["_target_"].rpartition(".")[0] == theirs["config"]["_target_"].rpartition(".")[0]
    for field, value in ours["config"].items():
        if field != "_target_":
            assert field in theirs["config"] and theirs["config"][field] == value, field


def test_tokenizer_context_matches_nemos_own(tmp_path):
    """The tokenizer we name in io.json is the object NeMo's io_dump writes for a model given
    ``AutoTokenizer(<dir>/nemo_tokenizer)`` (as NeMo's HF importers give it): same class, path,
    arguments and values; our model.yaml's tokenizer fields are NeMo's."""
    nemo_dir = CONFIGS / "tokenizer"

    def tokenizer_object(io_path):
        doc = json.loads(io_path.read_text())
        (obj,) = [o for o in doc["objects"].values() if o.get("paths") == ["<root>.model.tokenizer"]]
        meta = doc["objects"][obj["metadata"]["key"]]
        return dict(meta["items"])["Attr(name='fn_or_cls')"], obj["items"]

    (tmp_path / "io.json").write_text(io_json(LLAMA_CFG, tokenizer=True))
    assert tokenizer_object(tmp_path / "io.json") == tokenizer_object(nemo_dir / "io.json")
    assert config_paths(tmp_path / "io.json")["<root>.model.tokenizer"] == \
        config_paths(nemo_dir / "io.json")["<root>.model.tokenizer"]
    ours = yaml.safe_load(model_yaml(LLAMA_CFG, tokenizer=True))["tokenizer"]
    theirs = yaml.safe_load((nemo_dir / "model.yaml").read_text())["tokenizer"]
    assert ours.items() <= theirs.items() and theirs["pretrained_model_name"] == "nemo_tokenizer"
