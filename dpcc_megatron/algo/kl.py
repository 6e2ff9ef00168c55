"""Per-token KL estimators (Schulman's k1, k2, k3) and the reference-policy penalty.

``kl_terms(sample_logprobs, target_logprobs)`` estimates KL(p || q) per token from
tokens sampled from p, with log rho = log q - log p (clamped to +-clamp first):

==========  ==========================  =========================================
estimator   per-token term               properties
==========  ==========================  =========================================
``k1``      -log rho                     unbiased, high variance, can be negative
``k2``      (log rho)^2 / 2              biased, low variance, >= 0
``k3``      (rho - 1) - log rho          unbiased, low variance, >= 0 ("low_var_kl")
==========  ==========================  =========================================

Two directions are used in this package:

* policy drift KL(pi_old || pi_theta) on rollout tokens (sampled from pi_old):
  ``kl_terms(old_logprobs, logprobs)``; drives DPCC's tau_t and drift score;
* reference penalty KL(pi_theta || pi_ref) (tokens from pi_old ~ pi_theta):
  ``kl_terms(logprobs, ref_logprobs)`` gives its value.

The penalty's gradient. Differentiating an estimator's per-token term does not in
general give the gradient of the KL it estimates. With x ~ pi_theta and
d = log pi_theta(x) - log pi_ref(x), the true gradient is
grad KL(pi_theta || pi_ref) = E[d * grad log pi_theta(x)]. The k2 term's derivative is
exactly d * grad log pi_theta; k1's is grad log pi_theta (zero in expectation), and k3's is
(1 - pi_ref / pi_theta) grad log pi_theta, whose expectation is the gradient of the *other*
direction, KL(pi_ref || pi_theta). So :func:`ref_kl_penalty` takes its value from the
chosen estimator and its gradient from d * grad log pi_theta for every estimator: the
penalty pulls pi_theta toward pi_ref along grad KL(pi_theta || pi_ref), as documented.
"""
from __future__ import annotations

from typing import Optional

import torch

from .aggregation import LossNormalizer, aggregate

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_terms(sample_logprobs: torch.Tensor, target_logprobs: torch.Tensor, estimator: str = "k3",
             clamp: float = 20.0) -> torch.Tensor:
    """Per-token estimate of KL(p || q) for tokens sampled from p.

    Args:
        sample_logprobs: [B, T] log p of the sampled tokens.
        target_logprobs: [B, T] log q of the same tokens.
        estimator: ``k1``, ``k2`` or ``k3``.
        clamp: |log q - log p| is clamped to this, so every term is finite.
    Returns:
        [B, T] terms; average them over valid tokens for the estimate.
    """
    log_rho = (target_logprobs - sample_logprobs).clamp(-clamp, clamp)
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho.square()
    if estimator == "k3":
        return torch.expm1(log_rho) - log_rho  # expm1: exact near rho = 1, where it matters
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def kl_token_mean(sample_logprobs: torch.Tensor, target_logprobs: torch.Tensor, response_mask: torch.Tensor,
                  estimator: str = "k3", clamp: float = 20.0) -> torch.Tensor:
    """KL(p || q) averaged over valid tokens; 0-dim, detached, 0 when no token is valid.

    For a distributed measurement all-reduce ``(kl_terms * mask).sum()`` and ``mask.sum()`` instead.
    """
    with torch.no_grad():
        mask = response_mask.bool()
        terms = kl_terms(sample_logprobs.detach(), target_logprobs.detach(), estimator, clamp)
        total = torch.where(mask, terms, 0.0).sum()
        return total / mask.sum().clamp(min=1)


def ref_kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor,
                   coef: float, estimator: str = "k3", aggregation: str = "token_mean",
                   normalizer: Optional[LossNormalizer] = None, clamp: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """coef * KL(pi_theta || pi_ref), aggregated like the policy loss it is added to.

    The value is the ``estimator``'s; the gradient is coef * d * grad log pi_theta per token with
    d = clamp(log pi_theta - log pi_ref), the on-policy gradient of KL(pi_theta || pi_ref) whatever
    the estimator (see the module docstring).

    Args:
        logprobs: [B, T] current policy log-probs (with grad).
        ref_logprobs: [B, T] reference policy log-probs (no grad).
        response_mask: [B, T] valid tokens.
    Returns:
        (penalty, kl): the 0-dim penalty (a contribution when ``normalizer`` is given)
        and the detached KL token mean of this batch.
    """
    mask = response_mask.bool()
    # Masking the inputs (not only the terms) keeps padding garbage out of the gradient.
    lp = torch.where(mask, logprobs, 0.0)
    ref = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype), 0.0)
    terms = kl_terms(lp.detach(), ref, estimator, clamp)
    # value: the estimator's term (lp - sg(lp) is 0); gradient: sg(d) * grad log pi_theta.
    d = (lp.detach() - ref).clamp(-clamp, clamp)
    surrogate = terms + d * (lp - lp.detach())
    penalty = coef * aggregate(surrogate, mask, aggregation, normalizer)
    with torch.no_grad():
        kl = torch.where(mask, terms, 0.0).sum() / mask.sum().clamp(min=1)
    return penalty, kl.detach()
