"""Cross-rank agreement: the one place where ranks agree on a flag, an error or a few host values.

    if any_rank(problem is not None, group):   # every rank of the group takes the same branch
        ...
    error = first_error(error)                 # every rank raises the same message, or none does
    peak, rss = reduce_values([peak, rss], "max")

One device rule for every such collective (:func:`collective_device`): a group whose backend is
NCCL reduces on this rank's current CUDA device, any other (gloo, or a CPU run) on the host;
whether CUDA is merely available decides nothing. Without torch.distributed, or in a group of one,
each helper returns the local answer without a collective. Each helper is collective over its
group: every rank of it must call it, in the same order. Only torch, so every layer may use it.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def active(group=None) -> bool:
    """Whether ``group`` (default: the world) spans more than this rank under torch.distributed."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group=None) -> torch.device:
    """Where the tensors of a collective over ``group`` go: the current CUDA device under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)).split(","):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_values(values: Iterable[float], op: str = "sum", group=None) -> list[float]:
    """``values`` reduced element-wise over ``group`` (``op``: sum, max or min) in float64; the same list on
    every rank."""
    values = [float(v) for v in values]
    if not active(group) or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=_OPS[op], group=group)
    return [float(v) for v in t.cpu()]


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank of ``group`` when ``flag`` is true on any of them."""
    return reduce_values([1.0 if flag else 0.0], "max", group)[0] > 0


def every_rank(flag: bool, group=None) -> bool:
    """True on every rank of ``group`` when ``flag`` is true on all of them."""
    return reduce_values([1.0 if flag else 0.0], "min", group)[0] > 0


def first_error(error: Optional[str], group=None) -> Optional[str]:
    """The error of the lowest rank of ``group`` that has one, on every rank of it (None when no rank does)."""
    if not any_rank(error is not None, group):
        return None
    if not active(group):
        return error
    box: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(box, error, group=group)
    return next(e for e in box if e is not None)
