"""Qwen3 / Qwen3-MoE / Mixtral config.json -> ModelConfig, back, and the variants refused (no torch models)."""
import pytest

from dpcc_megatron.config import ConfigError, ModelConfig, ParallelConfig
from dpcc_megatron.convert.compat import architecture_of
from dpcc_megatron.convert.errors import ConversionError
from dpcc_megatron.convert.hf_config import check_layout, hf_config_from_model, model_config_from_hf

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
                 "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
                 "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16", "hidden_act": "silu"}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                "sliding_window": None, "max_position_embeddings": 32768, "router_jitter_noise": 0.0,
                "tie_word_embeddings": False}


def test_qwen3_moe_maps_the_expert_fields():
    cfg, notes = model_config_from_hf(QWEN3_30B_A3B)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (128, 8, 768)
    assert cfg.qk_layernorm and cfg.kv_channels == 128 and not cfg.moe_router_pre_softmax
    assert cfg.moe_aux_loss_coeff == 0.0 and any("router_aux_loss_coef" in n for n in notes)
    raw, _ = model_config_from_hf(dict(QWEN3_30B_A3B, norm_topk_prob=False))
    assert raw.moe_router_pre_softmax


def test_qwen3_dense_and_mixtral():
    dense, _ = model_config_from_hf(QWEN3_8B)
    assert dense.qk_layernorm and dense.num_moe_experts is None and not dense.add_qkv_bias
    mix, _ = model_config_from_hf(MIXTRAL_8X7B)
    assert (mix.num_moe_experts, mix.moe_router_topk, mix.moe_ffn_hidden_size) == (8, 2, 14336)
    assert not mix.qk_layernorm and not mix.moe_router_pre_softmax


@pytest.mark.parametrize("hf", [QWEN3_30B_A3B, dict(QWEN3_30B_A3B, norm_topk_prob=False), QWEN3_8B, MIXTRAL_8X7B],
                         ids=["qwen3_moe", "qwen3_moe_raw", "qwen3", "mixtral"])
def test_generated_config_round_trips(hf):
    cfg, _ = model_config_from_hf(hf)
    written = hf_config_from_model(cfg, "bf16")
    assert written["architectures"] == hf["architectures"]
    assert architecture_of(model_config_from_hf(written)[0]) == architecture_of(cfg)


@pytest.mark.parametrize("hf,field", [
    (dict(QWEN3_30B_A3B, decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(QWEN3_30B_A3B, mlp_only_layers=[0, 47]), "mlp_only_layers"),
    (dict(QWEN3_30B_A3B, shared_expert_intermediate_size=512), "shared_expert_intermediate_size"),
    (dict(MIXTRAL_8X7B, router_jitter_noise=0.01), "router_jitter_noise"),
    (dict(QWEN3_8B, attention_bias=True), "attention_bias"),
    (dict(QWEN3_8B, use_sliding_window=True), "use_sliding_window"),
    ({k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"}, "moe_intermediate_size"),
])
def test_unsupported_variants_are_refused_by_name(hf, field):
    with pytest.raises(ConversionError, match=field):
        model_config_from_hf(hf)


def test_expert_layout_checks():
    moe, _ = model_config_from_hf(QWEN3_30B_A3B)
    check_layout(moe, 4, 1, 8)
    with pytest.raises(ConversionError, match="EP=3 does not divide num_moe_experts=128"):
        check_layout(moe, 1, 1, 3)
    with pytest.raises(ConversionError, match="dense"):
        check_layout(model_config_from_hf(QWEN3_8B)[0], 1, 1, 2)
    dense, _ = model_config_from_hf(QWEN3_8B)
    with pytest.raises(ConversionError, match="QK layernorm"):
        hf_config_from_model(dense, "bf16", "LlamaForCausalLM")
    with pytest.raises(ConversionError, match="num_moe_experts=128"):
        hf_config_from_model(moe, "bf16", "Qwen3ForCausalLM")


def test_model_and_parallel_keys_are_validated():
    from dpcc_megatron.config.base import run_validate
    from dpcc_megatron.megatron.model import check_moe_layout

    with pytest.raises(ConfigError, match="moe_router_topk"):
        run_validate(ModelConfig(num_moe_experts=4, moe_router_topk=5), "model")
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff"):
        run_validate(ModelConfig(num_moe_experts=4, moe_aux_loss_coeff=-1.0), "model")
    with pytest.raises(ConfigError, match="moe_expert_capacity_factor"):
        run_validate(ModelConfig(num_moe_experts=4, moe_expert_capacity_factor=0.0), "model")
    with pytest.raises(ConfigError, match="expert_model_parallel_size"):
        run_validate(ParallelConfig(expert_model_parallel_size=0), "parallel")
    with pytest.raises(ConfigError, match="expert_model_parallel_size.*no experts"):
        check_moe_layout(ModelConfig(), ParallelConfig(expert_model_parallel_size=2))
    with pytest.raises(ConfigError, match="must divide model.num_moe_experts=4"):
        check_moe_layout(ModelConfig(num_moe_experts=4), ParallelConfig(expert_model_parallel_size=3))
    with pytest.raises(ConfigError, match="sequence_parallel"):
        check_moe_layout(ModelConfig(num_moe_experts=4), ParallelConfig(tensor_model_parallel_size=2))
    check_moe_layout(ModelConfig(num_moe_experts=4), ParallelConfig(tensor_model_parallel_size=2,
                                                                    sequence_parallel=True, expert_model_parallel_size=4))


@pytest.mark.parametrize("model_key", ["model.num_moe_experts=4", "model.qk_layernorm=true"])
def test_transformer_engine_with_moe_or_qk_norm_is_refused_at_load(model_key):
    from dpcc_megatron.config import load_config

    with pytest.raises(ConfigError, match=r"precision.transformer_engine.*local spec"):
        load_config(None, [model_key, "precision.transformer_engine=true"])
    assert not load_config(None, [model_key]).precision.transformer_engine
