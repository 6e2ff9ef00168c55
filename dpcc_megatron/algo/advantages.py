"""Group-relative advantages (one scalar per sampled response).

Rewards come in contiguous groups of ``group_size`` responses to the same prompt.

* ``grpo``:    A = (r - mean_g) / (std_g + eps), std with Bessel's correction (torch.std);
* ``dr_grpo``: A = r - mean_g (no std division: Dr.GRPO's unbiased form).

A group whose rewards are all equal carries no preference signal: its advantages are
exactly 0 (not round-off over eps) and it is counted in ``zero_variance_groups``.

Multi-part rewards [N, K] are combined with ``weights`` (default all 1). With
``per_component=True`` each component is normalised within its group first and the
normalised components are summed with the weights, so a track with a large spread
cannot drown the others; a group is zero-variance only when every component is constant.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

ADVANTAGE_MODES = ("grpo", "dr_grpo")


def group_advantages(rewards: torch.Tensor, group_size: int, mode: str = "grpo", eps: float = 1e-6,
                     per_component: bool = False,
                     weights: Optional[Sequence[float] | torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantages.

    Args:
        rewards: [N] or [N, K] (K reward components); N = num_groups * group_size.
        group_size: G, responses per prompt; groups are consecutive rows.
        mode: ``grpo`` or ``dr_grpo``.
        eps: added to the group std (grpo).
        per_component: normalise each component before combining ([N, K] only).
        weights: [K] component weights; None means 1 each.
    Returns:
        (advantages [N], metrics): metrics are detached 0-dim tensors: ``num_groups``,
        ``zero_variance_groups``, ``zero_variance_frac``, ``reward_mean``, ``reward_std``,
        ``adv_mean``, ``adv_std`` (reward stats of the weighted total).
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; known: {', '.join(ADVANTAGE_MODES)}")
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must be [N] or [N, K], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    if r.dim() == 1:
        r = r.unsqueeze(-1)
    k = r.shape[1]
    w = torch.ones(k, dtype=r.dtype, device=r.device) if weights is None \
        else torch.as_tensor(weights, dtype=r.dtype, device=r.device)
    if w.shape != (k,):
        raise ValueError(f"weights must have {k} entries, got shape {tuple(w.shape)}")
    total = r @ w
    if per_component and k > 1:
        adv_k, const_k = zip(*(_normalise(r[:, j], group_size, mode, eps) for j in range(k)))
        adv = torch.stack(adv_k, -1) @ w
        const = torch.stack(const_k, -1).all(-1)
    else:
        adv, const = _normalise(total, group_size, mode, eps)
    num_groups = const.numel()
    zero = torch.zeros((), device=r.device)
    metrics = {
        "num_groups": torch.full((), float(num_groups), device=r.device),
        "zero_variance_groups": const.sum().float(),
        "zero_variance_frac": const.float().mean() if num_groups else zero,
        "reward_mean": total.mean() if total.numel() else zero,
        "reward_std": total.std(correction=0) if total.numel() else zero,
        "adv_mean": adv.mean() if adv.numel() else zero,
        "adv_std": adv.std(correction=0) if adv.numel() else zero,
    }
    return adv, {name: v.detach().float() for name, v in metrics.items()}


def _normalise(x: torch.Tensor, group_size: int, mode: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N] -> (advantages [N], constant-group flags [N / G])."""
    g = x.view(-1, group_size)
    # Exact equality, not std < tol: equal rewards must give exactly 0, and only they.
    const = g.amax(-1) == g.amin(-1)
    centred = g - g.mean(-1, keepdim=True)
    if mode == "grpo" and group_size > 1:
        centred = centred / (g.std(-1, keepdim=True) + eps)
    adv = torch.where(const.unsqueeze(-1), 0.0, centred)
    return adv.reshape(-1), const
