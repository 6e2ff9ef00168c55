"""The decoupled objective: the behaviour policy that sampled is not the proximal policy the trust
region is drawn around (decoupled PPO, Hilton et al. 2021, "Batch size-invariance for policy
optimization"; AReaL and verl write the same weight).

Three policies per token t of a response sampled by the rollout engine:

* pi_b, the *behaviour* policy: the weights the engine sampled with (up to ``rollout.max_staleness``
  optimizer-step versions old), its log-probs as the engine reported them (``sampler_logprobs``);
* pi_prox, the *proximal* policy: the trainer's weights at the start of the update, recomputed by the
  trainer (``old_logprobs``);
* pi_theta, the policy being updated.

The loss of every registered policy loss l becomes

    L(theta) = agg_t [ sg(w_t) * l_t(r_t, A_t) ],    r_t = pi_theta / pi_prox,
    w_t = min(pi_prox(y_t) / pi_b(y_t), C)                      (C = the behaviour cap),

so the trust region (PPO's clip, DPCC's tau_t) bounds the step from pi_prox, where the update starts,
and the truncated weight w corrects for the samples coming from pi_b. The truncation trades a small
bias for bounded variance (truncated importance sampling). The weight is applied by scaling A:
every registered loss except clip_cov/kl_cov is positively homogeneous in A (l(wA) = w l(A) for
w > 0), which tests/megatron/test_precision.py checks. The reference-KL penalty is not weighted.

With pi_b == pi_prox (synchronous sampling with an engine whose numerics equal the trainer's) every
w_t is exp(0) = 1 exactly and the loss is the synchronous one bit for bit. With a synchronous engine
whose numerics differ, w is the sampler/trainer mismatch correction ``precision.tis_cap`` has always
applied: one weight serves both, since staleness and numerics both make pi_b differ from pi_prox.

``kl_behaviour`` = KL(pi_b || pi_prox), estimated with k3 on the sampled tokens, measures how far off
policy the batch is; DPCC's controller reads it (docs/algorithm.md, "Off-policy batches").
"""
from __future__ import annotations

import math
from typing import Optional

import torch

DEFAULT_BEHAVIOUR_CAP = 2.0
"""C when ``rollout.max_staleness`` >= 1 and neither ``loss.behaviour_is_cap`` nor ``precision.tis_cap``
is set (verl's rollout importance-sampling threshold default)."""


def resolve_behaviour_cap(behaviour_is_cap: Optional[float], tis_cap: Optional[float],
                          max_staleness: int) -> Optional[float]:
    """The cap C of the run, or None for no behaviour weight (the synchronous loss).

    ``loss.behaviour_is_cap`` when set, else ``precision.tis_cap`` (the same weight under its
    synchronous name), else :data:`DEFAULT_BEHAVIOUR_CAP` when samples may be stale, else None."""
    if behaviour_is_cap is not None:
        return float(behaviour_is_cap)
    if tis_cap is not None:
        return float(tis_cap)
    return DEFAULT_BEHAVIOUR_CAP if max_staleness >= 1 else None


@torch.no_grad()
def behaviour_weights(prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                      cap: float) -> torch.Tensor:
    """w = sg(min(pi_prox / pi_b, cap)) per token, 0 where masked; all [B, T]; fp32 (fp64 for fp64 inputs)."""
    if not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(f"behaviour importance-weight cap must be a finite number >= 1, got {cap}")
    mask = mask.bool()
    dtype = torch.promote_types(torch.promote_types(prox_logprobs.dtype, behaviour_logprobs.dtype), torch.float32)
    log_w = torch.where(mask, prox_logprobs.to(dtype) - behaviour_logprobs.to(dtype), 0.0)
    return torch.where(mask, torch.exp(log_w).clamp(max=cap), 0.0)


def weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages times the [B, T] weights: the token's loss term times w."""
    return (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages) * weights


def weight_metrics(weights: torch.Tensor, mask: torch.Tensor, cap: float) -> dict[str, torch.Tensor]:
    """Mean weight and the share of tokens at the cap, over valid tokens (0-dim, detached)."""
    mask = mask.bool()
    n = mask.sum().clamp(min=1)
    return {"tis_weight_mean": weights.sum() / n, "tis_clip_frac": ((weights >= cap) & mask).sum() / n}


@torch.no_grad()
def behaviour_kl(prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                 clamp: float = 20.0) -> float:
    """k3 estimate of KL(pi_b || pi_prox) over valid tokens (sampled from pi_b); 0 without any."""
    mask = mask.bool()
    if not bool(mask.any()):
        return 0.0
    log_w = (prox_logprobs.double() - behaviour_logprobs.double())[mask].clamp(-clamp, clamp)
    return float((torch.expm1(log_w) - log_w).mean())


def decoupled_loss(loss, logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                   advantages: torch.Tensor, mask: torch.Tensor, config, cap: Optional[float], *,
                   normalizer=None, ref_logprobs: Optional[torch.Tensor] = None):
    """The decoupled objective of the registered ``loss`` (a :class:`~.registry.PolicyLoss`): its
    ratio against ``prox_logprobs``, each token weighted by :func:`behaviour_weights` against
    ``behaviour_logprobs``. ``cap`` None: no weight, the loss exactly as registered. Returns
    (loss, metrics), metrics with ``tis_weight_mean`` and ``tis_clip_frac`` when weighted."""
    extra = {}
    if cap is not None:
        if behaviour_logprobs is None:
            raise ValueError("a behaviour importance weight needs the sampler's (behaviour) log-probs")
        w = behaviour_weights(prox_logprobs, behaviour_logprobs, mask, cap)
        advantages = weighted_advantages(advantages, w)
        extra = weight_metrics(w, mask, cap)
    value, metrics = loss(logprobs, prox_logprobs, advantages, mask, config=config, normalizer=normalizer,
                          ref_logprobs=ref_logprobs)
    metrics.update(extra)
    return value, metrics
