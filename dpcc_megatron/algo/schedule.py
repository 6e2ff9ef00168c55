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
