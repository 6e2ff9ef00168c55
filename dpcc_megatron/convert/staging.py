"""Staging for the converters that write a dist_checkpointing checkpoint from a meta-device model.

``dist_checkpointing.save`` takes the whole sharded state dict at once, so the converters first
write each tensor raw to a scratch file (one unit in memory at a time), then map the files back
with ``torch.from_file`` (file-backed, paged in on demand, evictable) as the data of the meta
model's sharded state dict. Each mapped tensor owns its storage exactly, so Megatron's writer
does not clone it; the SwiGLU halves are staged separately for the same reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from .errors import ConversionError
from .layout import canonical_name


class Stager:
    """Writes tensors raw to scratch files and maps them back, file-backed."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}

    def put(self, key: str, t: torch.Tensor) -> None:
        path = self.root / f"{len(self.files):06d}.raw"
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tofile(path)
        self.files[key] = (path, t.dtype, tuple(t.shape))

    def get(self, key: str) -> torch.Tensor:
        path, dtype, shape = self.files[key]
        numel = torch.Size(shape).numel()
        return torch.from_file(str(path), shared=False, size=numel, dtype=dtype).view(shape)


@contextlib.contextmanager
def scratch_stager(out: Path) -> Iterator[Stager]:
    """A Stager over a fresh scratch directory beside ``out`` (on its filesystem), removed afterwards."""
    scratch = out.parent / f".{out.name}.scratch-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield Stager(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _canonical(name: str, prefix: str) -> str:
    return canonical_name(name[len(prefix):] if prefix and name.startswith(prefix) else name)


def staged_targets(sharded: dict, prefix: str = "") -> dict[str, tuple]:
    """canonical name -> ('tensor', shape) or ('swiglu', [shape_gate, shape_up]) from the meta state
    dict (taken with ``sharded_state_dict(prefix=prefix)``; the prefix is not part of the name)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = {}
    for name, sh in sharded.items():
        if isinstance(sh, ShardedObject):
            continue
        canon = _canonical(name, prefix)
        if isinstance(sh, ShardedTensor):
            out[canon] = ("tensor", tuple(sh.local_shape))
        elif isinstance(sh, ShardedTensorFactory) and canon.endswith("linear_fc1.weight"):  # also experts
            out[canon] = ("swiglu", [tuple(p.local_shape) for p in sh.build()])
        else:
            raise ConversionError(f"unexpected entry {name} ({type(sh).__name__}) in the model's sharded state dict")
    return out


def attach_staged(sharded: dict, stager: Stager, prefix: str = "") -> dict:
    """The sharded state dict with every tensor's data replaced by its staged, file-backed copy."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    out = {}
    for name, sh in sharded.items():
        canon = _canonical(name, prefix)
        if isinstance(sh, ShardedObject):
            out[name] = sh
        elif isinstance(sh, ShardedTensorFactory):
            # Build the factory's two ShardedTensors ourselves, each over its own file: the
            # factory would chunk one tensor into views, which the writer then clones.
            parts = sh.build()
            out[name] = [dataclasses.replace(p, data=stager.get(f"{canon}#{i}")) for i, p in enumerate(parts)]
        else:
            out[name] = dataclasses.replace(sh, data=stager.get(canon))
    return out
