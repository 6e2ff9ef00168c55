"""Tensor layout: Hugging Face names and shapes <-> Megatron-Core checkpoint names and shapes.

Canonical names are the Megatron-Core state-dict names of a TP=1/PP=1 ``GPTModel`` with
global layer indices, spelled as the Transformer Engine spec spells them (norms fused
into the following linear layer). The local spec's ``input_layernorm`` and
``pre_mlp_layernorm`` are renamed to these by Megatron's own ``sharded_state_dict_keys_map``
when it checkpoints, so both specs share one checkpoint; :func:`canonical_name` applies the
same renaming to local-spec state-dict names.

The work is done per *unit* (the embedding, each layer, the final norm + output layer) so a
converter holds one unit at a time:

- q/k/v -> ``linear_qkv`` in Megatron's grouped layout ``[groups, (heads/groups + 2) * head_dim, ...]``:
  for each query group, its query heads, then its key head, then its value head;
- gate/up -> ``linear_fc1`` as ``[gate; up]`` (also in each expert);
- Qwen3's ``q_norm``/``k_norm`` -> ``q_layernorm``/``k_layernorm``;
- an MoE layer's router (Qwen3-MoE ``mlp.gate``, Mixtral ``block_sparse_moe.gate``) -> ``mlp.router``,
  and expert ``e`` (``gate_proj``/``up_proj``/``down_proj``, Mixtral's ``w1``/``w3``/``w2``) ->
  ``mlp.experts.local_experts.e``. Each expert is a unit of its own, so a converter holds one
  expert at a time, not a whole MoE layer;
- the vocabulary is unpadded here; padding to Megatron's size is the checkpoint writer's job.
"""
from __future__ import annotations

from typing import Callable, Iterator, Union

import torch

from ..config import ModelConfig

Unit = Union[str, int, tuple]  # "embedding", a layer index, (layer, expert), or "final"

EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"

# Megatron's local-spec sharded_state_dict_keys_map (get_gpt_layer_local_spec).
_LOCAL_TO_CANONICAL = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                       "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def canonical_name(name: str) -> str:
    for local, canon in _LOCAL_TO_CANONICAL.items():
        name = name.replace(f".{local}", f".{canon}")
    return name


_EXPERT = ".mlp.experts.local_experts."


def units(cfg: ModelConfig) -> list[Unit]:
    experts = cfg.num_moe_experts or 0
    layers = [u for i in range(cfg.num_layers) for u in (i, *((i, e) for e in range(experts)))]
    return ["embedding", *layers, "final"]


def unit_of(canonical: str) -> Unit:
    if canonical.startswith("decoder.layers."):
        layer = int(canonical.split(".")[2])
        if _EXPERT in canonical:
            return layer, int(canonical.split(_EXPERT)[1].split(".")[0])
        return layer
    if canonical.startswith("embedding."):
        return "embedding"
    return "final"


def _dims(cfg: ModelConfig) -> tuple[int, int, int]:
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    head_dim = cfg.kv_channels or cfg.hidden_size // heads
    return heads, groups, head_dim


def hf_shapes(cfg: ModelConfig, unit: Unit) -> dict[str, tuple[int, ...]]:
    """HF tensor names of ``unit`` and their shapes, in file order."""
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size or 4 * cfg.hidden_size
    heads, groups, hd = _dims(cfg)
    if unit == "embedding":
        return {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    if unit == "final":
        out = {"model.norm.weight": (h,)}
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = (cfg.vocab_size, h)
        return out
    if isinstance(unit, tuple):
        expert_ffn = cfg.moe_ffn_hidden_size or ffn
        gate, up, down = _expert_names(cfg, *unit)
        return {gate: (expert_ffn, h), up: (expert_ffn, h), down: (h, expert_ffn)}
    p = f"model.layers.{unit}."
    out = {p + "input_layernorm.weight": (h,),
           p + "self_attn.q_proj.weight": (heads * hd, h),
           p + "self_attn.k_proj.weight": (groups * hd, h),
           p + "self_attn.v_proj.weight": (groups * hd, h)}
    if cfg.add_qkv_bias:
        out.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (groups * hd,),
                    p + "self_attn.v_proj.bias": (groups * hd,)})
    if cfg.qk_layernorm:
        out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    out.update({p + "self_attn.o_proj.weight": (h, heads * hd), p + "post_attention_layernorm.weight": (h,)})
    if cfg.num_moe_experts is not None:
        out[_router_name(cfg, unit)] = (cfg.num_moe_experts, h)
        return out
    out.update({p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn)})
    return out


def _moe_prefix(cfg: ModelConfig, layer: int) -> str:
    # Qwen3-MoE (the family with QK layernorm) names its MoE block `mlp`, Mixtral `block_sparse_moe`.
    return f"model.layers.{layer}." + ("mlp." if cfg.qk_layernorm else "block_sparse_moe.")


def _router_name(cfg: ModelConfig, layer: int) -> str:
    return _moe_prefix(cfg, layer) + "gate.weight"


def _expert_names(cfg: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of (gate, up, down) of one expert."""
    p = f"{_moe_prefix(cfg, layer)}experts.{expert}."
    if cfg.qk_layernorm:
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
    return p + "w1.weight", p + "w3.weight", p + "w2.weight"


def _expert_canonical(layer: int, expert: int) -> str:
    return f"decoder.layers.{layer}{_EXPERT}{expert}."


def all_hf_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    for u in units(cfg):
        yield from hf_shapes(cfg, u).items()


def qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Interleave per query group: [q heads of group g; k_g; v_g] for g in groups (weights or biases)."""
    rest = q.shape[1:]
    qg = q.reshape(groups, -1, *rest)
    kg = k.reshape(groups, -1, *rest)
    vg = v.reshape(groups, -1, *rest)
    if qg.shape[1] != kg.shape[1] * (heads // groups):
        raise ValueError(f"q has {q.shape[0]} rows, k {k.shape[0]}: not {heads} heads in {groups} groups")
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def qkv_from_mcore(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    rest = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * head_dim, *rest)
    q = x[:, : per * head_dim].reshape(-1, *rest)
    k = x[:, per * head_dim: (per + 1) * head_dim].reshape(-1, *rest)
    v = x[:, (per + 1) * head_dim:].reshape(-1, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def iter_hf_to_canonical(cfg: ModelConfig, unit: Unit, get: Callable[[str], torch.Tensor]
                         ) -> Iterator[tuple[str, tuple[torch.Tensor, ...]]]:
    """The canonical tensors of ``unit``, reading HF tensors through ``get`` only as needed.

    Each canonical tensor comes as row blocks whose concatenation it is: ``linear_fc1`` as
    (gate, up), which are also the two halves Megatron checkpoints separately, everything
    else as one block. Nothing is kept between items, so a caller streaming them out holds
    at most one projection plus its inputs."""
    if unit == "embedding":
        yield EMBED, (get("model.embed_tokens.weight"),)
        return
    if unit == "final":
        yield FINAL_NORM, (get("model.norm.weight"),)
        if not cfg.tie_embeddings:
            yield OUTPUT, (get("lm_head.weight"),)
        return
    if isinstance(unit, tuple):
        gate, up, down = _expert_names(cfg, *unit)
        e = _expert_canonical(*unit)
        yield e + "linear_fc1.weight", (get(gate), get(up))
        yield e + "linear_fc2.weight", (get(down),)
        return
    heads, groups, _ = _dims(cfg)
    p, m = f"model.layers.{unit}.", f"decoder.layers.{unit}."
    a = p + "self_attn."
    yield m + "self_attention.linear_qkv.layer_norm_weight", (get(p + "input_layernorm.weight"),)
    yield m + "self_attention.linear_qkv.weight", (qkv_to_mcore(
        get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"), heads, groups),)
    if cfg.add_qkv_bias:
        yield m + "self_attention.linear_qkv.bias", (qkv_to_mcore(
            get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"), heads, groups),)
    if cfg.qk_layernorm:
        yield m + "self_attention.q_layernorm.weight", (get(a + "q_norm.weight"),)
        yield m + "self_attention.k_layernorm.weight", (get(a + "k_norm.weight"),)
    yield m + "self_attention.linear_proj.weight", (get(a + "o_proj.weight"),)
    yield m + "mlp.linear_fc1.layer_norm_weight", (get(p + "post_attention_layernorm.weight"),)
    if cfg.num_moe_experts is not None:
        yield m + "mlp.router.weight", (get(_router_name(cfg, unit)),)
        return
    yield m + "mlp.linear_fc1.weight", (get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight"))
    yield m + "mlp.linear_fc2.weight", (get(p + "mlp.down_proj.weight"),)


def canonical_to_hf(cfg: ModelConfig, unit: Unit, can: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`iter_hf_to_canonical`, in :func:`hf_shapes` order; the vocabulary is cut to
    ``cfg.vocab_size`` rows (padding rows are dropped)."""
    if unit == "embedding":
        return {"model.embed_tokens.weight": can[EMBED][: cfg.vocab_size]}
    if unit == "final":
        out = {"model.norm.weight": can[FINAL_NORM]}
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = can[OUTPUT][: cfg.vocab_size]
        return out
    if isinstance(unit, tuple):
        gate_name, up_name, down_name = _expert_names(cfg, *unit)
        e = _expert_canonical(*unit)
        gate, up = torch.chunk(can[e + "linear_fc1.weight"], 2, dim=0)
        return {gate_name: gate.contiguous(), up_name: up.contiguous(), down_name: can[e + "linear_fc2.weight"]}
    heads, groups, hd = _dims(cfg)
    p, m = f"model.layers.{unit}.", f"decoder.layers.{unit}."
    q, k, v = qkv_from_mcore(can[m + "self_attention.linear_qkv.weight"], heads, groups, hd)
    out = {p + "input_layernorm.weight": can[m + "self_attention.linear_qkv.layer_norm_weight"],
           p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v}
    if cfg.add_qkv_bias:
        qb, kb, vb = qkv_from_mcore(can[m + "self_attention.linear_qkv.bias"], heads, groups, hd)
        out.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                    p + "self_attn.v_proj.bias": vb})
    if cfg.qk_layernorm:
        out.update({p + "self_attn.q_norm.weight": can[m + "self_attention.q_layernorm.weight"],
                    p + "self_attn.k_norm.weight": can[m + "self_attention.k_layernorm.weight"]})
    out.update({p + "self_attn.o_proj.weight": can[m + "self_attention.linear_proj.weight"],
                p + "post_attention_layernorm.weight": can[m + "mlp.linear_fc1.layer_norm_weight"]})
    if cfg.num_moe_experts is not None:
        out[_router_name(cfg, unit)] = can[m + "mlp.router.weight"]
        return out
    gate, up = torch.chunk(can[m + "mlp.linear_fc1.weight"], 2, dim=0)
    out.update({p + "mlp.gate_proj.weight": gate.contiguous(), p + "mlp.up_proj.weight": up.contiguous(),
                p + "mlp.down_proj.weight": can[m + "mlp.linear_fc2.weight"]})
    return out
