"""DPCC's scalar formulas: adaptive threshold, early-phase cap and drift-aware LR factor.

Plain floats in, plain floats out: the controller and external checks call these directly.
"""
from __future__ import annotations

import math


def adaptive_threshold(tau0: float, alpha: float, kl: float, tau_min: float) -> float:
    """tau = clamp(tau0 * (1 - alpha * kl), tau_min, tau0).

    ``kl`` is the smoothed KL(pi_old || pi_new); a larger drift tightens the trust region.
    """
    if tau_min > tau0:
        raise ValueError(f"tau_min ({tau_min}) must be <= tau0 ({tau0})")
    if math.isnan(kl):
        raise ValueError("kl must not be NaN")
    raw = tau0 if alpha == 0 else tau0 * (1.0 - alpha * kl)  # alpha = 0 with kl = inf is not NaN
    return min(max(raw, tau_min), tau0)


def early_phase_cap(step: int, total_steps: int, tau0: float, early_tau: float,
                    early_fraction: float, relax_fraction: float) -> float:
    """Upper bound on tau for optimizer step ``step`` (0-based).

    Steps with step < E = early_fraction * total_steps are capped at ``early_tau``; over
    the next R = relax_fraction * total_steps steps the cap rises linearly from
    ``early_tau`` to ``tau0`` (cap = early_tau + (tau0 - early_tau) * (step - E) / R);
    afterwards it is ``tau0``, i.e. no cap.
    """
    early = early_fraction * total_steps
    relax = relax_fraction * total_steps
    if step < early:
        return early_tau
    if step < early + relax:
        return early_tau + (tau0 - early_tau) * (step - early) / relax
    return tau0


def early_lr_warmup_factor(step: int, total_steps: int, early_fraction: float) -> float:
    """(step + 1) / E for optimizer step ``step`` (0-based) below E = early_fraction * total_steps, else 1.

    The early phase's LR warm-up: the first step of an iteration runs at ratio 1, where no
    threshold can act, so the conservative early phase also bounds the step size.
    """
    early = early_fraction * total_steps
    if step < early:
        return min(1.0, (step + 1) / early)
    return 1.0


def drift_lr_factor(drift: float, threshold: float) -> float:
    """min(1, 0.5 / (drift - threshold + 1)) when drift > threshold, else 1.

    It multiplies the scheduled LR of one step only; it is never folded into the schedule.
    """
    if drift > threshold:
        return min(1.0, 0.5 / (drift - threshold + 1.0))
    return 1.0


#: The smallest share of the drift budget an off-policy batch leaves the update (so the staleness LR
#: factor is at least sqrt(1/4) = 0.5).
STALENESS_BUDGET_FLOOR = 0.25


def staleness_lr_factor(behaviour_kl: float, threshold: float, weight: float = 1.0) -> float:
    """sqrt(max(theta - beta * kl_b, theta * STALENESS_BUDGET_FLOOR) / theta): the LR multiplier of an
    update whose batch was sampled ``behaviour_kl`` = KL(pi_b || pi_prox) away from where it starts.

    The drift budget theta (nats per token per iteration) is what the policy may move away from the
    policy that generated its data; an off-policy batch has spent beta * kl_b of it before the first
    step. With Adam the drift grows about as the square of the step size, so the LR that spends the
    remaining budget is the square root of its share. 1 when kl_b <= 0, beta = 0 or theta <= 0."""
    if math.isnan(behaviour_kl):
        raise ValueError("behaviour_kl must not be NaN")
    spent = weight * behaviour_kl
    if spent <= 0 or threshold <= 0:
        return 1.0
    return math.sqrt(max(threshold - spent, threshold * STALENESS_BUDGET_FLOOR) / threshold)


#: Largest cut of the KL-target LR scale per drift reading (a factor of 2), so one outlying reading
#: cannot throw the scale far; the largest raise is the caller's ``max_raise``.
KL_TARGET_MAX_CUT = 2.0


def kl_target_scale(scale: float, kl: float, target: float, gain: float, scale_min: float,
                    max_raise: float) -> float:
    """The KL-target rule's next LR scale after one drift reading ``kl`` (nats per token).

    log s <- clamp(log s - gain * log(kl / target), log scale_min, 0), a cut limited to a factor of
    ``KL_TARGET_MAX_CUT`` per reading and a raise to a factor of ``max_raise`` (> 1; the config's
    ``lr_scale_max_raise``). The scale latches: it falls while the drift is above ``target`` and
    recovers toward 1 while it is below, instead of resetting every step. With
    Adam the drift grows about as the square of the step size, so gain 0.5 corrects a reading in one go.
    A reading of 0 (or below: a k1 estimate) counts as far below the target."""
    if not (0 < scale_min <= scale <= 1):
        raise ValueError(f"scale must be in [scale_min={scale_min}, 1] with scale_min > 0, got {scale}")
    if target <= 0 or gain < 0:
        raise ValueError(f"target must be > 0 and gain >= 0, got target={target}, gain={gain}")
    if math.isnan(kl):
        raise ValueError("kl must not be NaN")
    if not max_raise > 1:
        raise ValueError(f"max_raise must be > 1, got {max_raise}")
    cut, raise_ = math.log(KL_TARGET_MAX_CUT), math.log(max_raise)
    if kl <= 0:
        change = raise_
    elif math.isinf(kl):
        change = -cut
    else:
        change = min(max(-gain * math.log(kl / target), -cut), raise_)
    return min(1.0, max(scale_min, scale * math.exp(change)))
