"""The conventional policy losses: grpo, dapo, dr_grpo, gspo, cispo (dpcc lives in dpcc.py).

All take r = exp(clamp(log pi_theta - log pi_old)) and a detached advantage A per token.
Hard-clipping losses give zero gradient to tokens that left the trust region in the
direction favoured by A: that is the "silent drop" DPCC avoids (``utilisation`` < 1).
"""
from __future__ import annotations

from typing import Optional

import torch

from dpcc_megatron.config.algo import LossConfig

from .registry import TokenInputs, TokenTerms, register_policy_loss


def ppo_clip_terms(x: TokenInputs, eps_low: float, eps_high: float, dual_clip_c: Optional[float]) -> TokenTerms:
    """PPO clipped surrogate per token: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)).

    With ``dual_clip_c`` the loss of A < 0 tokens is further capped at -c A.
    """
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    adv, ratio = x.advantages, x.ratio
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    with torch.no_grad():
        # The clipped branch wins (constant, zero gradient) when r left [lo, hi] in A's favour.
        dropped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        with torch.no_grad():
            dropped |= (adv < 0) & (cap < loss)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    active = x.mask & x.ratio_has_grad & ~dropped
    return TokenTerms(loss=loss, below=x.mask & (ratio < lo), above=x.mask & (ratio > hi), active=active)


@register_policy_loss("grpo", aggregation="seq_mean_token_mean")
def grpo(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """GRPO (DeepSeekMath): symmetric clip eps, mean over each sequence's tokens, then over sequences."""
    return ppo_clip_terms(x, cfg.clip_eps, cfg.clip_eps, cfg.dual_clip_c)


@register_policy_loss("dapo", aggregation="token_mean")
def dapo(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """DAPO: clip-higher (eps_low, eps_high), token-level mean over the whole batch."""
    return ppo_clip_terms(x, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c)


@register_policy_loss("dr_grpo", aggregation="token_sum_norm")
def dr_grpo(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """Dr.GRPO: the GRPO surrogate summed over tokens / (B * T_max): no length normalisation."""
    return ppo_clip_terms(x, cfg.clip_eps, cfg.clip_eps, cfg.dual_clip_c)


@register_policy_loss("gspo", aggregation="seq_mean")
def gspo(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """GSPO, token form: s_it = sg(s_i) * pi_theta / sg(pi_theta), s_i = exp(mean_t log r_it).

    Its value is the sequence ratio s_i on every token and its gradient is
    s_i * grad log pi_theta per token, so with a per-sequence A it equals GSPO exactly
    (and it also accepts per-token A). Clipped to [1 - eps_low, 1 + eps_high].
    """
    lo, hi = 1.0 - cfg.gspo_eps_low, 1.0 + cfg.gspo_eps_high
    lengths = x.mask.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(x.log_ratio.detach().sum(-1, keepdim=True) / lengths)  # [B, 1]
    token_ratio = seq_ratio * torch.exp(x.logprobs - x.logprobs.detach())
    adv = x.advantages
    loss = torch.maximum(-adv * token_ratio, -adv * token_ratio.clamp(lo, hi))
    with torch.no_grad():
        dropped = ((adv > 0) & (seq_ratio > hi)) | ((adv < 0) & (seq_ratio < lo))
        below, above = x.mask & (seq_ratio < lo), x.mask & (seq_ratio > hi)
    return TokenTerms(loss=loss, below=below, above=above, active=x.mask & ~dropped)


@register_policy_loss("cispo", aggregation="token_mean")
def cispo(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """CISPO (MiniMax-M1): -sg(min(r, 1 + eps_high)) * A * log pi_theta, token-level mean.

    The importance weight is truncated, never the gradient: every token keeps a
    REINFORCE gradient of weight in (0, 1 + eps_high].
    """
    hi = 1.0 + cfg.cispo_eps_high
    weight = x.ratio.detach().clamp(max=hi)
    loss = -x.advantages * weight * x.logprobs
    with torch.no_grad():
        above = x.mask & (x.ratio > hi)
    return TokenTerms(loss=loss, below=torch.zeros_like(above), above=above, active=x.mask)
