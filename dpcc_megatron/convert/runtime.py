"""Process-level plumbing for the converters: a one-process Megatron context, atomic output dirs."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from .errors import ConversionError


def hide_cuda() -> None:
    """Conversion is a CPU job: keep it off GPUs (call before anything initialises CUDA)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """torch.distributed (gloo, world size 1) and Megatron's parallel state at TP=1/PP=1,
    torn down afterwards if this context created them. dist_checkpointing needs both.
    Conversion is a CPU job: callers hide GPUs first (see :func:`hide_cuda`)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if torch.cuda.is_available():
        raise ConversionError("conversion runs on CPU: hide the GPUs (CUDA_VISIBLE_DEVICES=) for this process")
    from ..testing import enable_cpu_megatron

    # dist_checkpointing's writer assumes CUDA in places (current_device, synchronize);
    # the CPU execution layer redirects exactly those. It stays on for the process.
    enable_cpu_megatron()
    made_dist = not dist.is_initialized()
    if made_dist:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise ConversionError("conversion runs in one process; call it outside a multi-rank job")
    made_ps = not ps.model_parallel_is_initialized()
    if made_ps:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        if made_ps:
            ps.destroy_model_parallel()
        if made_dist:
            dist.destroy_process_group()


def check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise ConversionError(f"output directory {out} already exists (pass --overwrite to replace it)")
    if not out.parent.is_dir():
        raise ConversionError(f"parent directory of {out} does not exist")


@contextlib.contextmanager
def staged_dir(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``out``; on success it is renamed to ``out``,
    on failure removed. ``out`` never holds a partial result."""
    check_output_dir(out, overwrite)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
