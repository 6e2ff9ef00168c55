"""Gather the training shards into Hugging Face tensors, in memory, for a rollout engine's refit.

    pairs = gather_hf_weights(chunks, model_cfg, vocab_size=tok.vocab_size, dtype=torch.bfloat16,
                              tp_group=..., pp_group=...)
    # [(hf_name, tensor), ...] on the model-parallel group's rank 0 (TP rank 0, first stage); None elsewhere

* **TP.** Parameters Megatron marks ``tensor_model_parallel`` are all-gathered over ``tp_group`` and
  concatenated along their ``partition_dim``. SwiGLU's ``linear_fc1`` is ``[gate_r; up_r]`` on each TP
  rank, so every shard is split in halves and the gates, then the ups, are concatenated. QKV rows
  are grouped per query group and groups are split contiguously, so plain concatenation is right.
* **PP / VPP.** Local ``decoder.layers.i`` of a chunk is global layer ``i + offset``; TP rank 0 of
  each stage sends its full-TP tensors to the first stage (``gather_object`` over ``pp_group``).
* **Names.** Local-spec names become canonical (:func:`dpcc_megatron.convert.layout.canonical_name`)
  and then HF names with the conversion layer's mapping
  (:func:`~dpcc_megatron.convert.layout.canonical_to_hf`), which also drops the padded vocabulary
  rows (the model config passed in carries the real vocabulary size). With tied embeddings the last
  stage's ``output_layer`` copy is not sent.

No disk round trip; every rank of the job must call it (TP and PP groups are collective).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..convert.layout import canonical_name, canonical_to_hf, units
from .reshard import _layer_offset, local_to_global_name


def _size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _gather_tp(t: torch.Tensor, param, name: str, gated: bool, tp_group) -> Optional[torch.Tensor]:
    """The full tensor on TP rank 0 (None on the others)."""
    tp = _size(tp_group)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return t if tp == 1 or dist.get_rank(tp_group) == 0 else None
    send = t.contiguous()
    if dist.get_backend(tp_group) == "gloo" and send.dtype not in (torch.float32, torch.float64):
        send = send.float()  # gloo's collectives are not guaranteed for bf16/fp16
    parts = [torch.empty_like(send) for _ in range(tp)]
    dist.all_gather(parts, send, group=tp_group)
    if dist.get_rank(tp_group) != 0:
        return None
    dim = param.partition_dim
    if gated and (name.endswith("mlp.linear_fc1.weight") or name.endswith("mlp.linear_fc1.bias")):
        halves = [torch.chunk(p, 2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def gather_canonical(chunks, tp_group=None, pp_group=None) -> Optional[dict[str, torch.Tensor]]:
    """The canonical (TP=1/PP=1, global layer index, padded vocabulary) state dict on the first stage's
    TP rank 0; None on every other rank."""
    tp_rank = dist.get_rank(tp_group) if _size(tp_group) > 1 else 0
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        while hasattr(chunk, "module"):
            chunk = chunk.module
        offset = _layer_offset(chunk)
        tied = getattr(chunk, "share_embeddings_and_output_weights", False)
        gated = bool(chunk.config.gated_linear_unit)
        for name, param in chunk.named_parameters():
            key = local_to_global_name(name, offset)
            if key == "output_layer.weight" and tied:
                continue
            full = _gather_tp(param.detach(), param, name, gated, tp_group)
            if full is not None:
                local[canonical_name(key)] = full.cpu()
    if tp_rank != 0:
        return None
    if _size(pp_group) == 1:
        return local
    pp_rank = dist.get_rank(pp_group)
    box = [None] * dist.get_world_size(pp_group) if pp_rank == 0 else None
    dist.gather_object(local, box, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
    if pp_rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in box:
        merged.update(part)
    return merged


def canonical_to_hf_pairs(can: dict[str, torch.Tensor], model_cfg: ModelConfig, vocab_size: int,
                          dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs in file order; ``vocab_size`` rows of the embedding/output layer are kept."""
    cfg = dataclasses.replace(model_cfg, vocab_size=vocab_size)
    out = []
    for unit in units(cfg):
        for name, t in canonical_to_hf(cfg, unit, can).items():
            out.append((name, t.to(dtype).contiguous()))
    return out


def gather_hf_weights(chunks, model_cfg: ModelConfig, *, vocab_size: int, dtype: torch.dtype, tp_group=None,
                      pp_group=None) -> Optional[list[tuple[str, torch.Tensor]]]:
    can = gather_canonical(chunks, tp_group, pp_group)
    return None if can is None else canonical_to_hf_pairs(can, model_cfg, vocab_size, dtype)
