"""Move weights between the canonical full state dict and one rank's shards.

The canonical form is a TP=1, PP=1 ``GPTModel`` state dict with global layer
indices and the *unpadded* vocabulary. It is what HF conversion produces and
consumes, and what parity tests compare against. Each rank's local parameters
are slices of it:

- TP: parameters Megatron marks ``tensor_model_parallel`` are split along their
  ``partition_dim``. The SwiGLU ``linear_fc1`` weight is ``[gate; up]`` *per TP
  rank*, so gate and up are split separately. QKV needs no special case: its
  rows are already grouped per query group, and groups are split contiguously.
- Vocabulary: padded with zero rows to Megatron's padded size, then split.
- PP/VPP: local ``decoder.layers.i`` is global layer ``i + offset`` of its chunk.
- Tied embeddings: the last stage's ``output_layer.weight`` mirrors the embedding.
- Experts (``mlp.experts.local_experts.j``): expert-parallel rank r holds global experts
  ``r * local .. r * local + local - 1`` (local = experts / EP), each split over the expert
  tensor-parallel group (not the TP group), an expert's gated ``linear_fc1`` in gate and up halves.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def layer_offset(chunk) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(chunk.config, vp_stage=getattr(chunk, "vp_stage", None))


def local_to_global_name(name: str, offset: int) -> str:
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name


def _tp_slice(full: torch.Tensor, param: torch.Tensor, name: str, chunk, tp_rank: int, tp: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if chunk.config.gated_linear_unit and (name.endswith("linear_fc1.weight") or  # the dense MLP's and an expert's
                                           name.endswith("linear_fc1.bias")):
        gate, up = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(gate, tp, dim=dim)[tp_rank], torch.chunk(up, tp, dim=dim)[tp_rank]], dim=dim)
    return torch.chunk(full, tp, dim=dim)[tp_rank]


def _pad_vocab(full: torch.Tensor, padded: int) -> torch.Tensor:
    if full.shape[0] == padded:
        return full
    if full.shape[0] > padded:
        raise ValueError(f"vocabulary of {full.shape[0]} rows does not fit the padded size {padded}")
    pad = torch.zeros((padded - full.shape[0],) + tuple(full.shape[1:]), dtype=full.dtype)
    return torch.cat([full, pad], dim=0)


def global_expert_name(key: str, chunk, ep_rank: int) -> Optional[str]:
    """The name of a local expert parameter under its global expert index (None for any other name)."""
    m = LOCAL_EXPERT.match(key)
    if m is None:
        return None
    local = chunk.config.num_moe_experts // chunk.config.expert_model_parallel_size
    return f"{m.group(1)}{ep_rank * local + int(m.group(2))}{m.group(3)}"


def _expert_share(chunks: list) -> tuple[int, int, int]:
    """(expert-parallel rank, expert-TP rank, expert-TP size) of this rank; (0, 0, 1) without experts."""
    if not any(c.config.num_moe_experts for c in chunks):
        return 0, 0, 1
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size())


def load_full_state_dict(chunks: Iterable[torch.nn.Module], full: dict[str, torch.Tensor],
                         tp_rank: Optional[int] = None, tp: Optional[int] = None) -> None:
    """Copy this rank's slices of the canonical ``full`` state dict into ``chunks`` (experts under their
    global index, taken from this rank's expert-parallel share and split over the expert TP group)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    tp = ps.get_tensor_model_parallel_world_size() if tp is None else tp
    chunks = [getattr(c, "module", c) for c in chunks]
    ep_rank, etp_rank, etp = _expert_share(chunks)
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        offset = layer_offset(chunk)
        tied = getattr(chunk, "share_embeddings_and_output_weights", False)
        for name, param in chunk.named_parameters():
            key = local_to_global_name(name, offset)
            if key == "output_layer.weight" and tied:
                key = "embedding.word_embeddings.weight"
            expert = global_expert_name(key, chunk, ep_rank)
            key = expert or key
            if key not in full:
                raise KeyError(f"canonical state dict has no {key} (needed for local {name})")
            value = full[key]
            if key in _VOCAB_KEYS:
                value = _pad_vocab(value, param.shape[0] * (tp if getattr(param, "tensor_model_parallel", False) else 1))
            value = _tp_slice(value, param, name, chunk, *((etp_rank, etp) if expert else (tp_rank, tp)))
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{key}: canonical slice has shape {tuple(value.shape)}, "
                                 f"local parameter {name} has {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value.to(param.dtype))


def local_named_tensors(chunks: Iterable[torch.nn.Module], grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's parameters (or their ``.main_grad``/``.grad``) keyed by global name."""
    out = {}
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            if grads:
                g = getattr(param, "main_grad", None)
                t = g if g is not None else param.grad
                if t is None:
                    continue
            else:
                t = param
            out[local_to_global_name(name, offset)] = t.detach().clone().cpu()
    return out


def shard_like(chunks: Iterable[torch.nn.Module], full: dict[str, torch.Tensor],
               tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The slices of ``full`` (e.g. reference gradients) that this rank's parameters hold, keyed like
    :func:`local_named_tensors` (experts: this rank's expert-parallel share, split over expert TP)."""
    out = {}
    chunks = [getattr(c, "module", c) for c in chunks]
    ep_rank, etp_rank, etp = _expert_share(chunks)
    for chunk in chunks:
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            key = local_to_global_name(name, offset)
            src = "embedding.word_embeddings.weight" if (
                key == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False)) else key
            expert = global_expert_name(key, chunk, ep_rank)
            src = expert or src
            if src not in full:
                continue
            value = full[src]
            if src in _VOCAB_KEYS:
                value = _pad_vocab(value, param.shape[0] * (tp if getattr(param, "tensor_model_parallel", False) else 1))
            out[key] = _tp_slice(value, param, name, chunk, *((etp_rank, etp) if expert else (tp_rank, tp)))
    return out
