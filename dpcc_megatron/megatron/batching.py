"""Token-budget micro-batches (``train.max_tokens_per_micro_batch``); pure torch.

Padding every micro-batch to the longest sequence of the whole batch spends most of the
FLOPs on padding when response lengths are long-tailed. Here the rows are sorted by their
used length (prompt + response), longest first, and packed greedily into micro-batches of at
most ``max_tokens`` padded tokens, each cut to its own longest row (rounded up to
``multiple_of``, e.g. the TP size under sequence parallelism). The rows' original order is
returned so per-token outputs can be put back.

Exactness is unaffected: every micro-batch returns its contribution to the mini-batch loss
under the global counts of the whole mini-batch (:func:`global_normalizer`), whatever the
micro-batch boundaries.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .rl_batch import RLBatch


def used_lengths(mask: torch.Tensor) -> torch.Tensor:
    """[N] tokens each row needs: up to and including its last response token (>= 2)."""
    n, t = mask.shape
    pos = torch.arange(t).expand(n, t)
    last = torch.where(mask.bool(), pos, -1).amax(-1)  # index of the last target; -1: no response
    return (last + 2).clamp(min=2)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack_by_tokens(lengths: list[int], max_tokens: int, multiple_of: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch: longest first, each holding <= ``max_tokens`` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        width = _round_up(lengths[i], multiple_of)
        if width > max_tokens:
            raise ValueError(f"train.max_tokens_per_micro_batch={max_tokens} is smaller than one sequence "
                             f"({lengths[i]} tokens{f', {width} padded' if width != lengths[i] else ''})")
        if groups:
            cur = groups[-1]
            cur_width = _round_up(lengths[cur[0]], multiple_of)  # the first row is the group's longest
            if (len(cur) + 1) * cur_width <= max_tokens:
                cur.append(i)
                continue
        groups.append([i])
    return groups


def token_budget_micro_batches(batch: "RLBatch", max_tokens: int, multiple_of: int = 1):
    """-> (micro-batches, order): each micro-batch cut to its own length; ``order`` [N] lists the
    original row of each row of the concatenated micro-batches."""
    lengths = used_lengths(batch.mask).tolist()
    groups = pack_by_tokens(lengths, max_tokens, multiple_of)
    full = batch.tokens.shape[1]
    parts = []
    for rows in groups:
        width = min(full, _round_up(max(lengths[i] for i in rows), multiple_of))
        mb = batch.select(torch.tensor(rows, dtype=torch.long))
        parts.append(mb.truncate(width) if width < full else mb)
    order = torch.tensor([i for rows in groups for i in rows], dtype=torch.long)
    return parts, order


def scatter_rows(parts: list[torch.Tensor], order: torch.Tensor, width: int, cut: bool = False) -> torch.Tensor:
    """Inverse of the packing for per-token outputs: [n_mb, L_mb - 1] pieces -> [N, width] in the
    original row order, zero-padded on the right (``cut``: pieces longer than ``width``, e.g. with
    sequence-parallel padding, are cut to it)."""
    n = int(order.numel())
    ref = parts[0]
    out = torch.zeros((n, width), dtype=ref.dtype, device=ref.device)
    start = 0
    for p in parts:
        if cut:
            p = p[:, :width]
        rows = order[start:start + p.shape[0]].to(ref.device)
        out[rows, :p.shape[1]] = p
        start += p.shape[0]
    return out
