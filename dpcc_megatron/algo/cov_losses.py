"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models"), as verl formulates them; baselines for entropy collapse.

Both single out the tokens whose centred covariance between advantage and log-prob,
cov_t = (A_t - mean A) (log pi_t - mean log pi) over the call's valid tokens, is large: those
are the tokens whose update drives entropy down.

* ``clip_cov``: the PPO clipped surrogate (symmetric ``clip_eps``); among the tokens PPO did
  not clip whose cov lies in (``clip_cov_lb``, ``clip_cov_ub``), ``clip_cov_ratio`` of the valid
  tokens (at least one) lose their gradient. verl draws that subset with an unseeded
  ``randperm``; here the draw comes from a generator seeded by the call's shape and token count,
  so every rank and every rerun drops the same tokens.
* ``kl_cov``: the unclipped surrogate -A r; the top ``kl_cov_ratio`` of valid tokens by cov
  (at least one) add ``kl_cov_coef`` * |log r|.

The statistics are over the tokens of one loss call, i.e. one micro-batch, as in verl (whose
loss also runs per micro-batch), so these two losses depend on the micro-batch partition;
the others do not. Aggregation: token mean.
"""
from __future__ import annotations

import torch

from dpcc_megatron.config.algo import LossConfig

from .losses import ppo_clip_terms
from .registry import TokenInputs, TokenTerms, register_policy_loss


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def token_covariance(x: TokenInputs) -> torch.Tensor:
    """cov_t of every token ([B, T], detached; -inf at masked positions)."""
    with torch.no_grad():
        adv, lp, m = x.advantages, x.logprobs.detach(), x.mask
        cov = (adv - _masked_mean(adv, m)) * (lp - _masked_mean(lp, m))
        return torch.where(m, cov, -torch.inf)


@register_policy_loss("clip_cov", aggregation="token_mean")
def clip_cov(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """PPO clip, plus no gradient for a small random share of high-covariance, unclipped tokens."""
    base = ppo_clip_terms(x, cfg.clip_eps, cfg.clip_eps, None)
    with torch.no_grad():
        lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps
        clipped = (-x.advantages * x.ratio.clamp(lo, hi) > -x.advantages * x.ratio) & x.mask
        cov = token_covariance(x)
        candidates = x.mask & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
        n_valid = int(x.mask.sum())
        k = max(int(cfg.clip_cov_ratio * n_valid), 1)
        idx = torch.nonzero(candidates)
        if len(idx) > k:
            g = torch.Generator().manual_seed(x.mask.shape[0] * 1_000_003 + x.mask.shape[1] * 7919 + n_valid)
            idx = idx[torch.randperm(len(idx), generator=g)[:k].to(idx.device)]
        keep = torch.ones_like(x.mask)
        keep[idx[:, 0], idx[:, 1]] = False
    n = x.mask.sum().clamp(min=1)
    return TokenTerms(loss=base.loss * keep, below=base.below, above=base.above, active=base.active & keep,
                      extras={"cov_frac": (~keep & x.mask).sum() / n})


@register_policy_loss("kl_cov", aggregation="token_mean")
def kl_cov(x: TokenInputs, cfg: LossConfig) -> TokenTerms:
    """Unclipped surrogate, plus coef * |log r| on the top share of tokens by covariance."""
    with torch.no_grad():
        cov = token_covariance(x)
        n_valid = int(x.mask.sum())
        selected = torch.zeros_like(x.mask)
        if n_valid:
            k = max(int(n_valid * cfg.kl_cov_ratio), 1)
            top = torch.topk(cov.reshape(-1), k).indices
            selected.view(-1)[top] = True
    loss = -x.advantages * x.ratio + torch.where(selected, cfg.kl_cov_coef * x.log_ratio.abs(), 0.0)
    none = torch.zeros_like(x.mask)
    n = x.mask.sum().clamp(min=1)
    return TokenTerms(loss=loss, below=none, above=none, active=x.mask & x.ratio_has_grad,
                      extras={"cov_frac": (selected & x.mask).sum() / n})
