"""The DPCC policy loss: a truncated importance weight inside a moving trust region.

Per valid token, with w = clip(r, 1/tau_t, tau_t) and sg = stop-gradient:

    l_t = -A_t * sg(w_t) * pi_theta / sg(pi_theta)          (value -A_t w_t)
    grad_{log pi_theta} l_t = -A_t * w_t

Inside [1/tau_t, tau_t] this is exactly the gradient of the PPO surrogate -A r. A token
outside is not dropped: its weight is truncated to the boundary, so it still
contributes a gradient of magnitude in [|A|/tau_t, tau_t |A|] (never zero, never
more than tau_t |A|). Aggregation: token-level mean. tau_t comes from
``config.dpcc.tau`` (set each step by DPCCController), tau0 when unset.
"""
from __future__ import annotations

import torch

from dpcc_megatron.config.algo import LossConfig

from .registry import TokenInputs, TokenTerms, register_policy_loss


@register_policy_loss("dpcc", aggregation="token_mean")
def dpcc(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """DPCC loss per token (see module docstring)."""
    tau = cfg.dpcc.tau if cfg.dpcc.tau is not None else cfg.dpcc.tau0
    if not tau > 1:
        raise ValueError(f"dpcc threshold tau must be > 1, got {tau}")
    weight = x.ratio.detach().clamp(1.0 / tau, tau)
    # pi/sg(pi) = exp(lp - sg(lp)): value 1, gradient grad log pi; it bypasses the log-ratio
    # clamp, so even |log r| > clamp keeps its (truncated) gradient.
    loss = -x.advantages * weight * torch.exp(x.logprobs - x.logprobs.detach())
    with torch.no_grad():
        below, above = x.mask & (x.ratio < 1.0 / tau), x.mask & (x.ratio > tau)
    return TokenTerms(loss=loss, below=below, above=above, active=x.mask,
                      extras={"tau": torch.full((), float(tau), device=loss.device)})
