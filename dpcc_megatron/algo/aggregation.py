"""How per-token loss terms become one scalar, exactly, across micro-batches and DP ranks.

Each registered loss declares one aggregation:

==========================  ===============================================  ==================
aggregation                 full-batch value                                 global counts
==========================  ===============================================  ==================
``token_mean``              sum_{i,t} l_it / num_tokens                      num_tokens
``seq_mean_token_mean``     sum_i (sum_t l_it / n_i) / num_seqs              num_seqs
``seq_mean``                same formula; l_it is a sequence-level term      num_seqs
``token_sum_norm``          sum_{i,t} l_it / (num_rows * max_len)            num_rows, max_len
==========================  ===============================================  ==================

n_i is the number of valid tokens of row i; ``num_seqs`` counts rows with n_i > 0
(an all-masked row is padding, not a sequence), ``num_rows`` counts every row
(Dr.GRPO's constant denominator B * T_max) and ``max_len`` is T_max.

Every numerator is a sum over rows, so with the GLOBAL denominators of a
:class:`LossNormalizer` each micro-batch returns its *contribution* and the sum of
contributions over micro-batches and ranks is the full-batch loss, in value and in
gradient. Build it with ``LossNormalizer.from_mask`` per micro-batch and reduce with
:meth:`LossNormalizer.combine` (or all-reduce: SUM the counts, MAX ``max_len``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Optional

import torch

AGGREGATIONS: dict[str, tuple[str, ...]] = {
    "token_mean": ("num_tokens",),
    "seq_mean_token_mean": ("num_seqs",),
    "seq_mean": ("num_seqs",),
    "token_sum_norm": ("num_rows", "max_len"),
}


@dataclass(frozen=True)
class LossNormalizer:
    """Global denominators of one optimizer step's mini-batch (all micro-batches, all DP ranks).

    Only the counts that the loss's aggregation needs (``AGGREGATIONS``) must be set.
    """

    num_tokens: Optional[float] = None
    """Valid (unmasked) tokens."""
    num_seqs: Optional[float] = None
    """Rows with at least one valid token."""
    num_rows: Optional[float] = None
    """All rows, including all-masked ones."""
    max_len: Optional[int] = None
    """T_max of ``token_sum_norm`` (the padded length, or the generation budget)."""

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor) -> "LossNormalizer":
        """Local counts of one [B, T] mask."""
        mask = response_mask.bool()
        return cls(num_tokens=float(mask.sum()), num_seqs=float(mask.any(-1).sum()),
                   num_rows=float(mask.shape[0]), max_len=int(mask.shape[1]))

    @classmethod
    def combine(cls, parts: Iterable["LossNormalizer"]) -> "LossNormalizer":
        """Counts of the union of micro-batches: sums, and the max of ``max_len``."""
        parts = list(parts)
        out = {}
        for f in fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            if not vals or any(v is None for v in vals):
                out[f.name] = None
            else:
                out[f.name] = max(vals) if f.name == "max_len" else sum(vals)
        return cls(**out)


def aggregate(token_losses: torch.Tensor, response_mask: torch.Tensor, aggregation: str,
              normalizer: Optional[LossNormalizer] = None) -> torch.Tensor:
    """Reduce per-token terms to a scalar.

    Args:
        token_losses: [B, T] per-token terms (values at masked positions are ignored).
        response_mask: [B, T] bool, valid tokens.
        aggregation: a key of ``AGGREGATIONS``.
        normalizer: global counts; None uses this batch's own counts.
    Returns:
        0-dim tensor: the mean, or with ``normalizer`` this batch's contribution to it.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    mask = response_mask.bool()
    masked = torch.where(mask, token_losses, 0.0)
    if aggregation == "token_mean":
        total = masked.sum()
        denom = mask.sum() if normalizer is None else _need(normalizer, "num_tokens", aggregation)
    elif aggregation in ("seq_mean_token_mean", "seq_mean"):
        lengths = mask.sum(-1)
        total = (masked.sum(-1) / lengths.clamp(min=1)).sum()
        denom = (lengths > 0).sum() if normalizer is None else _need(normalizer, "num_seqs", aggregation)
    else:  # token_sum_norm
        total = masked.sum()
        if normalizer is None:
            denom = mask.shape[0] * mask.shape[1]
        else:
            denom = _need(normalizer, "num_rows", aggregation) * _need(normalizer, "max_len", aggregation)
    # An empty batch has a zero numerator; clamping keeps 0/0 out and the graph connected.
    if isinstance(denom, torch.Tensor):
        return total / denom.clamp(min=1).to(total.dtype)
    return total / max(float(denom), 1.0)


def _need(normalizer: LossNormalizer, count: str, aggregation: str) -> float:
    value = getattr(normalizer, count)
    if value is None:
        raise ValueError(f"aggregation {aggregation} needs LossNormalizer.{count} (got None)")
    return float(value)
