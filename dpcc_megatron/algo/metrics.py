"""Loss metrics and how to combine them across micro-batches and DP ranks.

Every policy loss returns detached 0-dim tensors. Each key has a reduction in
``METRIC_REDUCTIONS``: ``(op, weight_key)``:

* ``("mean", w)``: a mean over this call's items, ``w`` counts them; combine as
  sum(value * w) / sum(w) (0 when sum(w) == 0). All-reduce SUM of value*w and of w.
* ``("sum", None)``: counts, and ``pg_loss``/``ref_kl_loss``, which are contributions
  when the loss got the global ``LossNormalizer`` (so they add up to the full-batch loss).
* ``("min", w)`` / ``("max", w)``: extremes over this call's valid tokens; a call with
  w == 0 reports the neutral 1.0 and must be skipped (all-reduce: substitute +inf/-inf).

Keys: ``pg_loss``, ``clip_frac_low``/``clip_frac_high`` (valid tokens whose ratio lies
below/above the loss's bounds), ``ratio_mean``/``ratio_min``/``ratio_max`` (token ratio
pi_theta/pi_old), ``kl_k1``/``kl_k2``/``kl_k3`` (KL(pi_old || pi_theta) token means, one per estimator),
``utilisation`` (valid tokens with nonzero advantage whose gradient is nonzero, over
those tokens; 1.0 when there are none), the weights ``num_tokens``, ``num_adv_tokens``
and ``num_seqs``, ``tau`` (dpcc), ``cov_frac`` (clip_cov/kl_cov: share of tokens singled out) and, with a reference penalty, ``ref_kl``/``ref_kl_loss``.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import torch

METRIC_REDUCTIONS: dict[str, tuple[str, Optional[str]]] = {
    "pg_loss": ("sum", None),
    "ref_kl_loss": ("sum", None),
    "clip_frac_low": ("mean", "num_tokens"),
    "clip_frac_high": ("mean", "num_tokens"),
    "ratio_mean": ("mean", "num_tokens"),
    "ratio_min": ("min", "num_tokens"),
    "ratio_max": ("max", "num_tokens"),
    "kl_k1": ("mean", "num_tokens"),
    "kl_k2": ("mean", "num_tokens"),
    "kl_k3": ("mean", "num_tokens"),
    "ref_kl": ("mean", "num_tokens"),
    "utilisation": ("mean", "num_adv_tokens"),
    "tau": ("max", None),
    "cov_frac": ("mean", "num_tokens"),
    "num_tokens": ("sum", None),
    "num_adv_tokens": ("sum", None),
    "num_seqs": ("sum", None),
}


def combine_metrics(parts: Iterable[Mapping[str, torch.Tensor | float]],
                    reductions: Optional[Mapping[str, tuple[str, Optional[str]]]] = None) -> dict[str, float]:
    """Combine the metrics of several loss calls (micro-batches, ranks) into the full-batch values.

    ``reductions`` adds or overrides entries of ``METRIC_REDUCTIONS`` (for custom losses).
    """
    table = {**METRIC_REDUCTIONS, **(reductions or {})}
    parts = [{k: float(v) for k, v in p.items()} for p in parts]
    keys = list(dict.fromkeys(k for p in parts for k in p))
    out: dict[str, float] = {}
    for key in keys:
        if key not in table:
            raise KeyError(f"no reduction known for metric {key!r}; pass it in `reductions`")
        op, weight_key = table[key]
        items = [(p[key], p.get(weight_key, 1.0) if weight_key else 1.0) for p in parts if key in p]
        if op == "sum":
            out[key] = sum(v for v, _ in items)
        elif op == "mean":
            total_w = sum(w for _, w in items)
            out[key] = sum(v * w for v, w in items) / total_w if total_w > 0 else 0.0
        elif op in ("min", "max"):
            live = [v for v, w in items if w > 0]
            out[key] = (min(live) if op == "min" else max(live)) if live else 1.0
        else:
            raise ValueError(f"unknown reduction {op!r} for metric {key!r}")
    return out


@torch.no_grad()
def token_metrics(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  below: torch.Tensor, above: torch.Tensor, active: torch.Tensor) -> dict[str, torch.Tensor]:
    """The shared metrics of one loss call; all inputs [B, T], ``log_ratio`` already clamped."""
    lr = log_ratio.detach().float()
    n_tok = mask.sum().float()
    denom = n_tok.clamp(min=1)
    ratio = torch.exp(lr)
    has_tok = n_tok > 0
    adv_tok = mask & (advantages != 0)
    n_adv = adv_tok.sum().float()
    used = (active & adv_tok).sum().float()
    return {
        "clip_frac_low": (below & mask).sum().float() / denom,
        "clip_frac_high": (above & mask).sum().float() / denom,
        "ratio_mean": torch.where(mask, ratio, 0.0).sum() / denom,
        "ratio_min": torch.where(has_tok, torch.where(mask, ratio, math.inf).amin(), 1.0),
        "ratio_max": torch.where(has_tok, torch.where(mask, ratio, -math.inf).amax(), 1.0),
        "kl_k1": torch.where(mask, -lr, 0.0).sum() / denom,
        "kl_k2": torch.where(mask, 0.5 * lr.square(), 0.0).sum() / denom,
        "kl_k3": torch.where(mask, torch.expm1(lr) - lr, 0.0).sum() / denom,
        "utilisation": torch.where(n_adv > 0, used / n_adv.clamp(min=1), 1.0),
        "num_tokens": n_tok,
        "num_adv_tokens": n_adv,
        "num_seqs": mask.any(-1).sum().float(),
    }
