"""Hugging Face ``config.json`` <-> :class:`ModelConfig`, for the families converted exactly.

Everything here is plain dict/dataclass work (no torch), so it is cheap to test. Anything
the Megatron model cannot reproduce exactly is refused with the reason, never approximated:
a silently different rotary table or a dropped bias shows up later as a log-prob gap.
"""
from __future__ import annotations

from typing import Optional

from ..config import ModelConfig
from .errors import ConversionError

# HF architecture -> model_type.
SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
_BY_TYPE = {v: k for k, v in SUPPORTED.items()}

# Megatron-Core's RotaryEmbedding._apply_scaling (0.16.x) takes only `factor` from the
# caller; these three are its hard-coded defaults (the Llama 3.1 values).
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def architecture(hf: dict) -> str:
    """The supported architecture name of ``hf`` (a parsed config.json), or a ConversionError."""
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in SUPPORTED]
    if known:
        return known[0]
    if not archs and hf.get("model_type") in _BY_TYPE:
        return _BY_TYPE[hf["model_type"]]
    got = ", ".join(archs) if archs else f"model_type={hf.get('model_type')!r}"
    raise ConversionError(f"unsupported architecture {got}; supported: {', '.join(SUPPORTED)}")


def hf_dtype_name(hf: dict) -> Optional[str]:
    """The checkpoint dtype the config declares ('bf16', 'fp16', 'fp32'), None if unset.

    Raises for a declared dtype that has no exact fp32/bf16/fp16 representation."""
    raw = hf.get("dtype", hf.get("torch_dtype"))
    if raw is None or raw == "auto":
        return None
    raw = str(raw).replace("torch.", "")
    if raw not in _DTYPE_NAMES:
        raise ConversionError(f"config.json declares dtype {raw!r}; only float32, bfloat16 and float16 "
                              "checkpoints convert exactly (quantized checkpoints are not supported)")
    return _DTYPE_NAMES[raw]


def rope_settings(hf: dict) -> tuple[float, Optional[dict]]:
    """(rotary base, llama3 scaling dict or None) from old (rope_theta/rope_scaling) or
    transformers>=5 (rope_parameters) configs."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(theta)
    if not theta.is_integer():
        # Megatron's builder passes rotary_base as an int.
        raise ConversionError(f"rope_theta={theta} is not an integer; the Megatron model cannot reproduce it")
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ConversionError(f"rope scaling type {rope_type!r} is not supported (supported: none, llama3)")
    out = {"rope_type": "llama3", "factor": float(scaling.get("factor", 8.0))}
    for key, fixed in MEGATRON_LLAMA3_FIXED.items():
        value = float(scaling.get(key, fixed))
        if value != fixed:
            raise ConversionError(
                f"llama3 rope scaling with {key}={value:g}: Megatron-Core's rotary embedding hard-codes "
                f"{key}={fixed:g}, so the converted model would compute different rotary frequencies")
        out[key] = fixed if key != "original_max_position_embeddings" else int(fixed)
    return theta, out


def _head_dim(hf: dict) -> int:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return int(head_dim) if head_dim else hidden // heads


def model_config_from_hf(hf: dict) -> tuple[ModelConfig, list[str]]:
    """Map a parsed config.json onto ModelConfig. Returns (config, notes for the user)."""
    arch = architecture(hf)
    notes: list[str] = []
    try:
        hidden, heads, layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
        ffn, vocab = int(hf["intermediate_size"]), int(hf["vocab_size"])
    except KeyError as e:
        raise ConversionError(f"config.json has no {e.args[0]}") from None
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"hidden_act={act!r} is not supported (the SwiGLU MLP uses silu)")
    if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ConversionError("Llama with attention_bias/mlp_bias is not supported: Megatron's add_qkv_bias "
                              "has no o_proj bias and add_bias_linear adds biases HF does not have")
    if arch in QK_NORM and hf.get("attention_bias"):
        raise ConversionError(f"{arch} with attention_bias=true is not supported: it adds an o_proj bias "
                              "Megatron's add_qkv_bias does not have")
    if arch in ("Qwen2ForCausalLM", *QK_NORM) and (hf.get("use_sliding_window") or
                                       "sliding_attention" in (hf.get("layer_types") or [])):
        raise ConversionError(f"{arch} with use_sliding_window=true is not supported (Megatron uses full attention)")
    max_seq = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None
    if window and int(window) < max_seq:
        notes.append(f"sliding_window={window}: the Megatron model uses full attention, identical for "
                     f"sequences up to {window} tokens; max_seq_len set to {window}")
        max_seq = int(window)
    theta, scaling = rope_settings(hf)
    head_dim = _head_dim(hf)
    groups = int(hf.get("num_key_value_heads") or heads)
    cfg = ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        vocab_size=vocab, max_seq_len=max_seq, normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), swiglu=True,
        add_qkv_bias=arch == "Qwen2ForCausalLM", add_bias_linear=False, position_embedding_type="rope",
        rotary_base=theta, rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)), qk_layernorm=arch in QK_NORM,
        **_moe_fields(hf, arch, notes),
    )
    _validate(cfg)
    return cfg, notes


def _moe_fields(hf: dict, arch: str, notes: list[str]) -> dict:
    """The ModelConfig MoE fields of a Qwen3-MoE or Mixtral config.json; refuses, naming the field,
    what the Megatron MoE layer cannot reproduce."""
    if arch not in MOE:
        return {}
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    topk = hf.get("num_experts_per_tok")
    if experts is None or topk is None:
        raise ConversionError(f"config.json has no {'num_experts_per_tok' if experts else 'num_local_experts'}")
    out = {"num_moe_experts": int(experts), "moe_router_topk": int(topk)}
    if arch == "Qwen3MoeForCausalLM":
        step = int(hf.get("decoder_sparse_step", 1))
        if step != 1:
            raise ConversionError(f"decoder_sparse_step={step} is not supported: every layer must be an MoE layer")
        if hf.get("mlp_only_layers"):
            raise ConversionError(f"mlp_only_layers={hf['mlp_only_layers']} is not supported: every layer must "
                                  "be an MoE layer")
        for key in ("shared_expert_intermediate_size", "num_shared_experts"):
            if hf.get(key):
                raise ConversionError(f"{key}={hf[key]} is not supported (no shared experts)")
        if "moe_intermediate_size" not in hf:
            raise ConversionError("config.json has no moe_intermediate_size")
        out["moe_ffn_hidden_size"] = int(hf["moe_intermediate_size"])
        # norm_topk_prob: renormalise the top-k of the full softmax, i.e. softmax over the top-k logits.
        out["moe_router_pre_softmax"] = not bool(hf.get("norm_topk_prob", False))
    else:
        out["moe_ffn_hidden_size"] = int(hf["intermediate_size"])
    jitter = float(hf.get("router_jitter_noise", 0.0) or 0.0)
    if jitter:
        raise ConversionError(f"router_jitter_noise={jitter:g} is not supported: Megatron's router has no "
                              "multiplicative jitter (set it to 0)")
    if hf.get("router_aux_loss_coef"):
        notes.append(f"router_aux_loss_coef={hf['router_aux_loss_coef']} is a training setting: set "
                     "model.moe_aux_loss_coeff in the training config to use it")
    return out


def _validate(cfg: ModelConfig) -> None:
    from ..config import ConfigError
    from ..config.base import run_validate

    try:
        run_validate(cfg, "model")
    except ConfigError as e:
        raise ConversionError(f"config.json maps to an invalid model config: {e}") from None


def check_layout(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> None:
    """Refuse a TP/PP/EP layout the model cannot be split into, naming the quantity."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ConversionError(f"--tp, --pp and --ep must be >= 1, got tp={tp} pp={pp} ep={ep}")
    if ep > 1 and cfg.num_moe_experts is None:
        raise ConversionError(f"--ep {ep} needs a mixture-of-experts model; this one is dense (num_moe_experts: null)")
    if cfg.num_moe_experts is not None and cfg.num_moe_experts % ep:
        raise ConversionError(f"EP={ep} does not divide num_moe_experts={cfg.num_moe_experts}")
    if cfg.num_moe_experts is not None and (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size or 0) % tp:
        raise ConversionError(f"TP={tp} does not divide moe_ffn_hidden_size={cfg.moe_ffn_hidden_size}")
    groups = cfg.num_query_groups or cfg.num_attention_heads
    problems = []
    if cfg.num_attention_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_attention_heads}")
    if groups % tp:
        problems.append(f"num_query_groups={groups}")
    if (cfg.ffn_hidden_size or 4 * cfg.hidden_size) % tp:
        problems.append(f"ffn_hidden_size={cfg.ffn_hidden_size}")
    if problems:
        raise ConversionError(f"TP={tp} does not divide {' and '.join(problems)}")
    if cfg.num_layers % pp:
        raise ConversionError(f"PP={pp} does not divide num_layers={cfg.num_layers}")


def hf_config_from_model(cfg: ModelConfig, dtype: str, architecture_name: Optional[str] = None) -> dict:
    """A config.json for ``cfg`` when the checkpoint carries no original one (e.g. trained from scratch)."""
    arch = architecture_name or _default_architecture(cfg)
    if arch not in SUPPORTED:
        raise ConversionError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED)}")
    if cfg.normalization != "RMSNorm" or not cfg.swiglu or cfg.add_bias_linear or cfg.position_embedding_type != "rope":
        raise ConversionError("only RMSNorm + SwiGLU + RoPE models without linear biases export to "
                              f"{', '.join(SUPPORTED)}")
    if cfg.qk_layernorm != (arch in QK_NORM):
        raise ConversionError(f"{arch} {'has' if arch in QK_NORM else 'has no'} QK layernorm, the checkpoint has "
                              f"qk_layernorm={cfg.qk_layernorm}")
    if (cfg.num_moe_experts is not None) != (arch in MOE):
        raise ConversionError(f"{arch} {'is' if arch in MOE else 'is not'} a mixture of experts, the checkpoint has "
                              f"num_moe_experts={cfg.num_moe_experts}")
    if arch == "MixtralForCausalLM" and cfg.moe_router_pre_softmax:
        raise ConversionError("MixtralForCausalLM renormalises the top-k router weights, the checkpoint has "
                              "moe_router_pre_softmax=true")
    if cfg.add_qkv_bias != (arch == "Qwen2ForCausalLM"):
        raise ConversionError(f"{arch} {'has' if arch == 'Qwen2ForCausalLM' else 'has no'} QKV bias, "
                              f"the checkpoint has add_qkv_bias={cfg.add_qkv_bias}")
    heads = cfg.num_attention_heads
    head_dim = cfg.kv_channels or cfg.hidden_size // heads
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling:
        rope = dict(cfg.rope_scaling, rope_theta=cfg.rotary_base)
    torch_dtype = {v: k for k, v in _DTYPE_NAMES.items()}[dtype]
    return {
        "architectures": [arch], "model_type": SUPPORTED[arch], "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size or 4 * cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": heads, "num_key_value_heads": cfg.num_query_groups or heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_epsilon,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
        # Both spellings: transformers>=5 reads rope_parameters, 4.x reads rope_theta/rope_scaling.
        "rope_parameters": rope, "rope_theta": cfg.rotary_base,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "initializer_range": cfg.init_method_std, "torch_dtype": torch_dtype,
        "attention_dropout": 0.0, "use_cache": True, **_moe_config(cfg, arch),
    }


def _default_architecture(cfg: ModelConfig) -> str:
    if cfg.num_moe_experts is not None:
        return "Qwen3MoeForCausalLM" if cfg.qk_layernorm else "MixtralForCausalLM"
    if cfg.qk_layernorm:
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if cfg.add_qkv_bias else "LlamaForCausalLM"


def _moe_config(cfg: ModelConfig, arch: str) -> dict:
    out: dict = {"attention_bias": False} if arch in QK_NORM else {}
    if arch not in MOE:
        return out
    experts = {"num_local_experts": cfg.num_moe_experts, "num_experts_per_tok": cfg.moe_router_topk,
               "output_router_logits": False, "router_aux_loss_coef": cfg.moe_aux_loss_coeff}
    if arch == "MixtralForCausalLM":
        return {**out, **experts, "intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                "router_jitter_noise": 0.0}
    return {**out, **experts, "num_experts": cfg.num_moe_experts, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "moe_intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            "norm_topk_prob": not cfg.moe_router_pre_softmax}


def with_dtype(hf: dict, dtype: str) -> dict:
    """A copy of config.json declaring ``dtype`` under whichever key(s) it already uses."""
    out = dict(hf)
    name = {v: k for k, v in _DTYPE_NAMES.items()}[dtype]
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]
    for k in keys:
        out[k] = name
    return out
