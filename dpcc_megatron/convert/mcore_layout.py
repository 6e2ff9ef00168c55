"""The TP=1/PP=1 checkpoint layout, taken from a GPTModel on the meta device, and unit-wise reads.

Megatron's own ``sharded_state_dict()`` of a meta-device model gives the exact keys, global
shapes, padded vocabulary and SwiGLU split of a checkpoint without allocating the model.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import torch

from ..config import ModelConfig, ParallelConfig, PrecisionConfig
from .errors import ConversionError
from .layout import OUTPUT, Unit, canonical_name, unit_of, units
from .mcore_format import DTYPE_NAMES, stored_dtype
from .stored import stored_entries


def meta_model(cfg: ModelConfig, dtype: torch.dtype):
    """A TP=1/PP=1 GPTModel on the meta device: its sharded_state_dict() is the exact checkpoint
    layout (keys, global shapes, padded vocabulary, SwiGLU factories) at no memory cost.
    Needs :func:`runtime.single_process_megatron`."""
    from ..megatron.model import build_gpt_model

    precision = PrecisionConfig(params_dtype=DTYPE_NAMES[dtype])
    with torch.device("meta"):
        model = build_gpt_model(cfg, ParallelConfig(), precision, pre_process=True, post_process=True)
    # Some modules (e.g. the local spec's torch norms) are created in fp32 whatever params_dtype
    # says; Megatron's Float16Module casts them for training. Do the same, so every tensor
    # of a converted checkpoint has the requested dtype.
    return model.to(dtype)


def layout_entries(cfg: ModelConfig, dtype: torch.dtype) -> dict[Unit, dict[str, object]]:
    """The meta model's sharded state dict, grouped by unit, keyed by canonical name.

    Extra-state objects are left out; with tied embeddings there is no separate output layer."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    grouped: dict[Unit, dict[str, object]] = {u: {} for u in units(cfg)}
    for name, sh in meta_model(cfg, dtype).sharded_state_dict().items():
        if isinstance(sh, ShardedObject):
            continue
        canon = canonical_name(name)
        if canon == OUTPUT and cfg.tie_embeddings:
            continue
        grouped[unit_of(canon)][canon] = sh
    return grouped


def _readable(sh, dtype: torch.dtype):
    """``sh`` with fresh data and its prepended (layer) axes made real, so it can be read alone.

    Megatron describes a layer's tensor as one slice of a [num_layers, ...] tensor through
    ``prepend_axis_num``; that form converts to a torch ShardedTensor which insists on holding
    every layer. As plain size-1 axes the same slice goes through DCP's per-chunk path."""
    p = sh.prepend_axis_num
    local = (1,) * p + tuple(sh.local_shape)
    data = torch.empty(local, dtype=dtype)
    return dataclasses.replace(sh, data=data, dtype=dtype, local_shape=local, prepend_axis_num=0), data


def iter_checkpoint_units(path: Path, cfg: ModelConfig) -> Iterator[tuple[Unit, dict[str, torch.Tensor]]]:
    """Yield (unit, canonical tensors) one unit at a time, each read with dist_checkpointing.load.

    Tensors come in their stored dtype; the vocabulary keeps Megatron's padding."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    stored, _ = stored_entries(path)
    for unit, entries in layout_entries(cfg, stored_dtype(path)).items():
        request, pieces = {}, {}
        for canon, sh in entries.items():
            # The SwiGLU factory's two halves are read as two tensors and concatenated here.
            pieces[canon] = []
            for i, piece in enumerate(sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]):
                if piece.key not in stored:
                    raise ConversionError(f"{path} has no tensor {piece.key}: not written for this model config")
                if not piece.allow_shape_mismatch and stored[piece.key][0] != tuple(piece.global_shape):
                    raise ConversionError(f"{piece.key}: the checkpoint holds {stored[piece.key][0]}, its model "
                                          f"config implies {tuple(piece.global_shape)}")
                # Read in the stored dtype (checkpoints may mix dtypes); the caller casts once.
                request[f"{canon}#{i}"], data = _readable(piece, stored[piece.key][1])
                pieces[canon].append(data.view(piece.local_shape))
        # A partial read by design: the whole-tensor access check does not apply.
        dist_checkpointing.load(request, str(path), validate_access_integrity=False)
        del request
        yield unit, {canon: torch.cat(ds) if len(ds) > 1 else ds[0] for canon, ds in pieces.items()}
