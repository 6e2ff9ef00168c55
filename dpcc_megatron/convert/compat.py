"""Does a checkpoint's architecture fit a model? Every differing field is named."""
from __future__ import annotations

from typing import Iterable, Optional

from ..config import ModelConfig


def architecture_of(cfg: ModelConfig) -> dict:
    """The fields that must match for weights to mean the same thing, with defaults resolved."""
    heads = cfg.num_attention_heads
    return {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "ffn_hidden_size": cfg.ffn_hidden_size or 4 * cfg.hidden_size, "num_attention_heads": heads,
            "num_query_groups": cfg.num_query_groups or heads, "kv_channels": cfg.kv_channels or cfg.hidden_size // heads,
            "vocab_size": cfg.vocab_size, "normalization": cfg.normalization, "norm_epsilon": cfg.norm_epsilon,
            "swiglu": cfg.swiglu, "add_qkv_bias": cfg.add_qkv_bias, "add_bias_linear": cfg.add_bias_linear,
            "position_embedding_type": cfg.position_embedding_type, "rotary_base": float(cfg.rotary_base),
            "rope_scaling": cfg.rope_scaling or None, "tie_embeddings": cfg.tie_embeddings,
            "qk_layernorm": cfg.qk_layernorm, **_moe_architecture(cfg.num_moe_experts, cfg.moe_router_topk,
                                                                  cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
                                                                  or 4 * cfg.hidden_size, cfg.moe_router_pre_softmax)}


def _moe_architecture(experts, topk, width, pre_softmax) -> dict:
    """The MoE fields; all None for a dense model."""
    if experts is None:
        return {"num_moe_experts": None, "moe_router_topk": None, "moe_ffn_hidden_size": None,
                "moe_router_pre_softmax": None}
    return {"num_moe_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": width,
            "moe_router_pre_softmax": bool(pre_softmax)}


def _architecture_of_chunk(chunk) -> dict:
    """What can be read back from a built GPTModel chunk, in ModelConfig terms."""
    c = chunk.config
    out = {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "ffn_hidden_size": c.ffn_hidden_size,
           "num_attention_heads": c.num_attention_heads, "num_query_groups": c.num_query_groups,
           "kv_channels": c.kv_channels, "normalization": c.normalization, "norm_epsilon": c.layernorm_epsilon,
           "swiglu": c.gated_linear_unit, "add_qkv_bias": c.add_qkv_bias, "add_bias_linear": c.add_bias_linear,
           "tie_embeddings": chunk.share_embeddings_and_output_weights,
           "position_embedding_type": chunk.position_embedding_type, "qk_layernorm": bool(c.qk_layernorm),
           **_moe_architecture(c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_router_pre_softmax)}
    if getattr(chunk, "rotary_base", None) is not None:
        out["rotary_base"] = float(chunk.rotary_base)
    return out


def architecture_diffs(chunks: Iterable, stored: ModelConfig, model_cfg: Optional[ModelConfig] = None) -> list[str]:
    """Every field in which the checkpoint's architecture differs from the model's (built chunks,
    and ``model_cfg`` when given), as 'field: checkpoint has X, the model has Y'."""
    want = architecture_of(stored)
    diffs = []
    if model_cfg is not None:
        have = architecture_of(model_cfg)
        diffs += [f"{k}: checkpoint has {want[k]!r}, the model has {have[k]!r}" for k in want if want[k] != have[k]]
    for chunk in chunks:
        for k, v in _architecture_of_chunk(chunk).items():
            line = f"{k}: checkpoint has {want[k]!r}, the model has {v!r}"
            if want[k] != v and line not in diffs:
                diffs.append(line)
        padded = getattr(chunk, "vocab_size", None)
        if padded is not None and padded < stored.vocab_size:
            diffs.append(f"vocab_size: checkpoint has {stored.vocab_size}, the model has only {padded} rows")
    return diffs
