"""config.json -> ModelConfig mapping, and the refusals that keep conversion exact (no torch models)."""
import pytest

from dpcc_megatron.convert.errors import ConversionError
from dpcc_megatron.convert.hf_config import (SUPPORTED, check_layout, hf_config_from_model, hf_dtype_name,
                                             model_config_from_hf, with_dtype)

LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False,
              "sliding_window": 32768, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
MISTRAL_V01 = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096,
               "max_position_embeddings": 32768}


def test_llama31_maps_every_field():
    cfg, notes = model_config_from_hf(LLAMA31)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (32, 4096, 14336)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (32, 8, None)
    assert cfg.vocab_size == 128256 and cfg.norm_epsilon == 1e-5 and cfg.rotary_base == 500000.0
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert cfg.swiglu and cfg.normalization == "RMSNorm" and not cfg.add_qkv_bias and not cfg.tie_embeddings
    assert notes == [] and hf_dtype_name(LLAMA31) == "bf16"


def test_transformers5_rope_parameters_are_read():
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(LLAMA31["rope_scaling"], rope_theta=500000.0)
    assert model_config_from_hf(v5)[0] == model_config_from_hf(LLAMA31)[0]


def test_qwen2_has_qkv_bias_and_tied_embeddings():
    cfg, _ = model_config_from_hf(QWEN25_05B)
    assert cfg.add_qkv_bias and cfg.tie_embeddings and cfg.num_query_groups == 2 and cfg.norm_epsilon == 1e-6
    assert cfg.rope_scaling is None and cfg.rotary_base == 1e6


def test_mistral_sliding_window_caps_sequence_length_with_a_note():
    cfg, notes = model_config_from_hf(MISTRAL_V01)
    assert cfg.num_query_groups == 8 and cfg.max_seq_len == 4096
    assert len(notes) == 1 and "sliding_window=4096" in notes[0]


def test_head_dim_other_than_hidden_over_heads_sets_kv_channels():
    cfg, _ = model_config_from_hf(dict(MISTRAL_V01, hidden_size=5120, head_dim=128))
    assert cfg.kv_channels == 128


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ConversionError) as e:
        model_config_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert "GPT2LMHeadModel" in str(e.value)
    for arch in SUPPORTED:
        assert arch in str(e.value)


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": dict(LLAMA31["rope_scaling"], low_freq_factor=2.0)}, "low_freq_factor=2"),
    ({"rope_scaling": dict(LLAMA31["rope_scaling"], original_max_position_embeddings=4096)},
     "original_max_position_embeddings=4096"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' is not supported"),
    ({"rope_theta": 10000.5, "rope_scaling": None}, "not an integer"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"torch_dtype": "int8"}, "'int8'"),
])
def test_what_megatron_cannot_reproduce_is_refused(change, match):
    with pytest.raises(ConversionError, match=match):
        cfg = dict(LLAMA31, **change)
        model_config_from_hf(cfg)
        hf_dtype_name(cfg)


def test_qwen2_sliding_window_is_refused():
    with pytest.raises(ConversionError, match="use_sliding_window"):
        model_config_from_hf(dict(QWEN25_05B, use_sliding_window=True))


@pytest.mark.parametrize("tp,pp,match", [(3, 1, "num_attention_heads=32"), (16, 1, "num_query_groups=8"),
                                         (1, 3, "num_layers=32")])
def test_layout_must_divide_heads_groups_and_layers(tp, pp, match):
    cfg, _ = model_config_from_hf(LLAMA31)
    check_layout(cfg, 8, 4)
    with pytest.raises(ConversionError, match=match):
        check_layout(cfg, tp, pp)


@pytest.mark.parametrize("src", [LLAMA31, QWEN25_05B])
def test_generated_config_maps_back_to_the_same_model(src):
    cfg, _ = model_config_from_hf(src)
    back, _ = model_config_from_hf(hf_config_from_model(cfg, "bf16"))
    assert back == cfg


def test_with_dtype_updates_the_keys_the_config_uses():
    assert with_dtype({"dtype": "float32"}, "bf16") == {"dtype": "bfloat16"}
    assert with_dtype({}, "fp16") == {"torch_dtype": "float16"}
