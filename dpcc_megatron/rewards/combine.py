"""Combining the tracks: per-track normalisation and (optionally dynamic) weights.

``total = w_base * norm(base) + w_adv * norm(advanced)`` with ``w_adv = 1 - w_base``.
Normalising each track separately (z-score within its group or over the batch)
keeps a track with a small spread from being drowned by the other; with
``normalize: none`` totals stay in [0, 1].

Dynamic weights move the base weight a step ``rate`` toward a target, clipped
to ``[min_base_weight, max_base_weight]``. The target puts the static prior
``s`` on a reliability ``r`` per track, ``s*r_b / (s*r_b + (1-s)*r_a)``:

* with a labelled eval set, ``r = max(0, 2*concordance - 1)`` (agreement with
  humans above chance);
* otherwise ``r = 1 - noise`` (test-retest noise, see ``reliability``), and the
  move away from ``s`` is scaled by ``1 - agreement`` between the tracks: when
  they agree there is no evidence that one of them is off.
"""
from __future__ import annotations

from typing import Optional

import torch

from .reliability import group_means, group_variances


def zscore_by_group(x: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - group mean) / (group std + eps); groups with no spread become 0."""
    x = x.to(torch.float64)
    centered = x - group_means(x, group_index)[group_index]
    return centered / (group_means(centered ** 2, group_index).sqrt()[group_index] + eps)


def normalize_track(x: torch.Tensor, group_index: torch.Tensor, mode: str, eps: float = 1e-6) -> torch.Tensor:
    """Normalise one track: ``none``, ``group`` (z-score within groups) or ``batch`` (over the batch)."""
    if mode == "none":
        return x.to(torch.float64)
    if mode == "group":
        return zscore_by_group(x, group_index, eps)
    if mode == "batch":
        return zscore_by_group(x, torch.zeros_like(group_index), eps)
    raise ValueError(f"unknown normalisation {mode!r}")


def gate_by_base_spread(advanced: torch.Tensor, base: torch.Tensor, group_index: torch.Tensor,
                        tol: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten the advanced track to its group mean where the base track has no spread.

    advanced, base: [n]; group_index: int64 [n] of contiguous group ids. Returns the gated
    advanced track (float64 [n]) and a bool [num_groups] mask of the gated groups. Where every
    rule score in a group is equal, the judge's remaining differences are not about correctness,
    and group-std advantages would blow them up to unit size; flattening keeps the group's mean
    (so batch-level comparisons are unchanged) and removes only that within-group spread.
    """
    adv = advanced.to(torch.float64)
    gated = group_variances(base, group_index) <= tol
    return torch.where(gated[group_index], group_means(adv, group_index)[group_index], adv), gated


class DynamicWeights:
    """The base/advanced weights and the reliability estimates behind them (resumable state)."""

    def __init__(self, cfg):
        d = cfg.dynamic
        self.enabled, self.static = d.enabled, cfg.base_weight
        self.static_advanced = cfg.advanced_weight  # validated to be 1 - base_weight
        self.lo, self.hi, self.rate, self.ema = d.min_base_weight, d.max_base_weight, d.rate, d.ema
        self.base_weight = min(self.hi, max(self.lo, self.static)) if self.enabled else self.static
        self.noise: dict[str, Optional[float]] = {"base": None, "advanced": None}
        self.agreement: Optional[float] = None
        self.label_agreement: dict[str, Optional[float]] = {"base": None, "advanced": None}

    @property
    def weights(self) -> dict[str, float]:
        if not self.enabled:
            return {"base": self.static, "advanced": self.static_advanced}
        return {"base": self.base_weight, "advanced": 1.0 - self.base_weight}

    def _smooth(self, old: Optional[float], new: Optional[float]) -> Optional[float]:
        if new is None:
            return old
        return new if old is None else self.ema * old + (1 - self.ema) * new

    def _prior_share(self, r_base: float, r_adv: float) -> float:
        s = self.static
        den = s * r_base + (1 - s) * r_adv
        return s if den <= 0 else s * r_base / den

    def target(self) -> float:
        lb, la = self.label_agreement["base"], self.label_agreement["advanced"]
        if lb is not None and la is not None:
            return self._prior_share(max(0.0, 2 * lb - 1), max(0.0, 2 * la - 1))
        nb, na = self.noise["base"], self.noise["advanced"]
        if nb is None and na is None:
            return self.static
        share = self._prior_share(1.0 - (nb or 0.0), 1.0 - (na or 0.0))
        gate = 1.0 - (self.agreement if self.agreement is not None else 0.0)
        return self.static + gate * (share - self.static)

    def update(self, noise: dict[str, Optional[float]], agreement: Optional[float],
               label_agreement: Optional[dict[str, Optional[float]]] = None) -> None:
        """Fold in one batch's measurements; moves the weights when enabled."""
        for k in self.noise:
            self.noise[k] = self._smooth(self.noise[k], noise.get(k))
        self.agreement = self._smooth(self.agreement, None if agreement is None else max(0.0, agreement))
        if label_agreement is not None:
            self.label_agreement = dict(label_agreement)
        if self.enabled:
            w = self.base_weight + self.rate * (self.target() - self.base_weight)
            self.base_weight = min(self.hi, max(self.lo, w))

    def state_dict(self) -> dict:
        return {"base_weight": self.base_weight, "noise": dict(self.noise), "agreement": self.agreement,
                "label_agreement": dict(self.label_agreement)}

    def load_state_dict(self, state: dict) -> None:
        self.base_weight = float(state["base_weight"])
        self.noise = dict(state["noise"])
        self.agreement = state["agreement"]
        self.label_agreement = dict(state["label_agreement"])
