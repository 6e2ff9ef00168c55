"""Reward-reliability statistics (pure functions over 1-D tensors; exported as metrics).

* ``within_group_variance`` / ``zero_variance_fraction``: GRPO learns nothing
  from a group whose rewards are all equal, so these track signal availability.
* ``within_group_pearson``: inter-track agreement on what GRPO uses, the
  ranking inside each group (the advanced track is group-relative by design,
  so a batch-level correlation would mostly compare group difficulty).
* ``concordance``: agreement with human labels, the share of label-ordered pairs
  (within a group) that a track orders the same way; ties count half.
* ``noise_ratio``: mean |re-score difference| over mean |difference between
  samples|, about 0 for a deterministic track and about 1 for pure noise.
"""
from __future__ import annotations

from typing import Optional

import torch


def group_means(x: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` within each group: float64 [num_groups] for contiguous ids in ``group_index``."""
    x = x.to(torch.float64)
    n = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(x))
    return torch.zeros(n, dtype=torch.float64).index_add_(0, group_index, x) / count


def group_variances(x: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Population variance of ``x`` within each group."""
    x = x.to(torch.float64)
    return group_means((x - group_means(x, group_index)[group_index]) ** 2, group_index)


def within_group_variance(x: torch.Tensor, group_index: torch.Tensor) -> float:
    v = group_variances(x, group_index)
    return float(v.mean()) if v.numel() else 0.0


def zero_variance_fraction(x: torch.Tensor, group_index: torch.Tensor, tol: float = 1e-12) -> float:
    v = group_variances(x, group_index)
    return float((v <= tol).double().mean()) if v.numel() else 0.0


def pearson(a: torch.Tensor, b: torch.Tensor) -> Optional[float]:
    """Correlation, or None when either side has no spread (agreement is then undefined)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    a, b = a - a.mean(), b - b.mean()
    den = (a.pow(2).sum() * b.pow(2).sum()).sqrt()
    if a.numel() < 2 or den <= 1e-12:
        return None
    return float((a * b).sum() / den)


def within_group_pearson(a: torch.Tensor, b: torch.Tensor, group_index: torch.Tensor) -> Optional[float]:
    """Correlation of the group-centred tracks; None when either has no spread inside any group."""
    def centred(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float64)
        n = int(group_index.max()) + 1
        count = torch.zeros(n, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(x))
        mean = torch.zeros(n, dtype=torch.float64).index_add_(0, group_index, x) / count
        return x - mean[group_index]

    if a.numel() < 2:
        return None
    return pearson(centred(a), centred(b))


def concordance(scores: torch.Tensor, labels: torch.Tensor, group_index: torch.Tensor) -> Optional[float]:
    """Pairwise ranking agreement with labels over pairs in the same group with different labels."""
    scores, labels = scores.to(torch.float64), labels.to(torch.float64)
    same = group_index[:, None] == group_index[None, :]
    ordered = (labels[:, None] > labels[None, :]) & same
    if not ordered.any():
        return None
    diff = scores[:, None] - scores[None, :]
    agree = (diff > 0).double() + 0.5 * (diff == 0).double()
    return float(agree[ordered].mean())


def mean_pairwise_gap(x: torch.Tensor) -> float:
    x = x.to(torch.float64)
    n = x.numel()
    if n < 2:
        return 0.0
    return float((x[:, None] - x[None, :]).abs().sum() / (n * (n - 1)))


def noise_ratio(first: torch.Tensor, second: torch.Tensor, spread: float) -> Optional[float]:
    """Test-retest noise of a track relative to its spread, clipped to [0, 1]; None without data."""
    if first.numel() == 0:
        return None
    gap = float((first.to(torch.float64) - second.to(torch.float64)).abs().mean())
    if spread <= 1e-12:
        return None if gap <= 1e-12 else 1.0
    return min(1.0, gap / spread)
