"""The DPCC policy loss: a truncated importance weight inside a moving trust region.

Per valid token, with w = clip(r, 1/tau_t, tau_t) and sg = stop-gradient:

    l_t = -A_t * sg(w_t) * pi_theta / sg(pi_theta)          (value -A_t w_t)
    grad_{log pi_theta} l_t = -A_t * w_t

Inside [1/tau_t, tau_t] this is exactly the gradient of the PPO surrogate -A r. A token
outside is not dropped: its weight is truncated to the boundary, so it still
contributes a gradient of magnitude in [|A|/tau_t, tau_t |A|] (never zero, never
more than tau_t |A|). Aggregation: token-level mean. tau_t comes from
``config.dpcc.tau`` (set each step by DPCCController), tau0 when unset.

With ``truncation: decay`` (the calibrated preset) the side a token is drifting to is treated
differently from the side that restores it. A token drifts when the update keeps pushing it the
way it has already moved: A > 0 with r > tau_t, or A < 0 with r < 1/tau_t. Its weight decays
smoothly from the boundary value,

    w_t = clip(r, 1/tau_t, tau_t) * exp(-k * (|log r| - log tau_t)),    k = decay_power,

so a token far outside the trust region still gets a gradient (never zero, never dropped) but
no longer the largest one. On the restoring side (A > 0 with r < 1/tau_t, A < 0 with r > tau_t)
the weight stays truncated to the boundary, as in ``clip``.
"""
from __future__ import annotations

import math

import torch

from dpcc_megatron.config.algo import LossConfig

from .registry import TokenInputs, TokenTerms, register_policy_loss


@register_policy_loss("dpcc", aggregation="token_mean")
def dpcc(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """DPCC loss per token (see module docstring)."""
    tau = cfg.dpcc.tau if cfg.dpcc.tau is not None else cfg.dpcc.tau0
    if not tau > 1:
        raise ValueError(f"dpcc threshold tau must be > 1, got {tau}")
    ratio = x.ratio.detach()
    weight = ratio.clamp(1.0 / tau, tau)
    if cfg.dpcc.truncation == "decay":
        excess = (x.log_ratio.detach().abs() - math.log(tau)).clamp_min(0.0)
        drifting = torch.where(x.advantages.detach() >= 0, ratio > tau, ratio < 1.0 / tau)
        weight = torch.where(drifting, weight * torch.exp(-cfg.dpcc.decay_power * excess), weight)
    # pi/sg(pi) = exp(lp - sg(lp)): value 1, gradient grad log pi; it bypasses the log-ratio
    # clamp, so even |log r| > clamp keeps its (truncated) gradient.
    loss = -x.advantages * weight * torch.exp(x.logprobs - x.logprobs.detach())
    with torch.no_grad():
        below, above = x.mask & (x.ratio < 1.0 / tau), x.mask & (x.ratio > tau)
    return TokenTerms(loss=loss, below=below, above=above, active=x.mask,
                      extras={"tau": torch.full((), float(tau), device=loss.device)})
