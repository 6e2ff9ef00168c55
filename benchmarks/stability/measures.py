"""Per-run measures from the trainer's outputs (pure Python; the detector is the judge of collapse).

A run *collapsed* when the monitor's collapse detector, run over its metric stream, raises

- a confirmed alert (a critical condition held ``collapse_confirm_steps`` iterations:
  entropy above the band, repetition, low entropy without learning, a per-step KL runaway,
  non-finite values), or
- ``low_entropy`` (the policy turned near-deterministic: entropy below the band for
  ``low_entropy_patience`` steps, or repetition), or
- ``reward_collapse`` (no reward variance for ``reward_collapse_patience`` steps) while the
  sampled rule reward is below ``SOLVED`` (a policy that solved the task is not collapsed),

or when the trainer stopped on non-finite steps. The other warnings (kl_drift, grad_spike,
high_entropy jumps) are counted per rule but are not a collapse.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from dpcc_megatron.monitor.detector import run_detector

BAND = (0.4, 2.0)
"""Normal entropy band as multiples of the warm-started policy's entropy."""
SOLVED = 0.9
"""Sampled rule reward at which uniform groups mean 'all right', not 'no signal'."""
SMOOTH = 3
"""Iterations in the moving mean of the sampled rule reward used for 'reached the target'."""


def _finite(values) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(values) -> Optional[float]:
    v = _finite(values)
    return sum(v) / len(v) if v else None


def moving_mean(values: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing mean over ``window`` values; NaN until a full window exists."""
    out = []
    for i in range(len(values)):
        chunk = _finite(values[i - window + 1: i + 1]) if i >= window - 1 else []
        out.append(sum(chunk) / len(chunk) if chunk else float("nan"))
    return out


def iterations_to_target(rewards: list[float], target: float, window: int = SMOOTH) -> Optional[int]:
    """1-based iteration at which the trailing mean first reaches ``target``; None if never."""
    for i, v in enumerate(moving_mean(rewards, window)):
        if math.isfinite(v) and v >= target:
            return i + 1
    return None


def judge_config(monitor_cfg, records: list[dict]):
    """The detector config that judges a run: its entropy band is set from the warm-started policy.

    Iteration 1's entropy is measured before any RL update, so it is the warm-started policy's
    (the same for every method of a seed). A run that collapses at once never has the healthy
    steps the detector would calibrate its band on, so the band is fixed here instead.
    """
    first = records[0].get("entropy") if records else None
    if not (isinstance(first, (int, float)) and math.isfinite(first) and first > 0):
        return monitor_cfg
    return dataclasses.replace(monitor_cfg, entropy_band=(BAND[0] * first, BAND[1] * first))


def is_collapse(alert, reward_at: dict) -> bool:
    """Whether one detector alert marks a collapse (see the module docstring)."""
    if alert.confirmed or alert.rule in ("low_entropy", "non_finite"):
        return True
    if alert.rule == "reward_collapse":
        r = reward_at.get(alert.iteration)
        return r is None or not math.isfinite(r) or r < SOLVED
    return False


def collapse_verdict(records: list[dict], monitor_cfg, stop_reason: str = "") -> dict:
    """Run the detector over ``records``; return collapsed / rule / iteration and every rule that fired."""
    alerts = run_detector(records, monitor_cfg)
    reward_at = {int(r["iteration"]): r.get("reward_base_mean", float("nan")) for r in records}
    collapses = [a for a in alerts if is_collapse(a, reward_at)]
    fired: dict[str, int] = {}
    for a in alerts:
        fired[a.rule] = fired.get(a.rule, 0) + 1
    confirmed = [a for a in alerts if a.confirmed]
    verdict = {"collapsed": bool(collapses), "collapse_rule": None, "collapse_iteration": None,
               "alerts_by_rule": fired,
               # what the product's own rules confirm (these would trigger a rollback in training)
               "detector_confirmed": confirmed[0].rule if confirmed else None,
               "first_alert": ({"rule": alerts[0].rule, "severity": alerts[0].severity,
                                "iteration": alerts[0].iteration} if alerts else None)}
    if collapses:
        verdict["collapse_rule"], verdict["collapse_iteration"] = collapses[0].rule, collapses[0].iteration
    elif "non-finite" in stop_reason:
        verdict.update(collapsed=True, collapse_rule="non_finite", collapse_iteration=len(records))
    return verdict


def run_measures(records: list[dict], summary: dict, monitor_cfg, target: float, wall_s: float) -> dict:
    """Everything the analysis needs from one run."""
    base = [r.get("reward_base_mean", float("nan")) for r in records]
    tail = base[-5:]
    # An iteration whose groups all have zero reward variance has no advantage tokens: utilisation is
    # undefined there (logged as null; trainers before that change logged 0), so it is skipped.
    util = [r.get("sample_utilization") for r in records
            if r.get("zero_var_frac", 0.0) < 1.0 and r.get("sample_utilization") is not None]
    # Share of samples whose group had reward variance: samples that carry any gradient at all.
    signal = [1.0 - r["zero_var_frac"] for r in records if isinstance(r.get("zero_var_frac"), (int, float))]
    # Share of all sampled tokens that pushed the policy: both effects together.
    effective = [(1.0 - r["zero_var_frac"]) * ((r.get("sample_utilization") or 0.0) if r["zero_var_frac"] < 1 else 0.0)
                 for r in records if isinstance(r.get("zero_var_frac"), (int, float))]
    out = {
        "iterations": len(records),
        "stop_reason": summary.get("stop_reason", ""),
        "reward_before": summary.get("reward_before"),
        "reward_after": summary.get("reward_after"),
        "reward_base_first": base[0] if base else None,
        "reward_base_last5": _mean(tail),
        "reward_base_curve": base,
        "iters_to_target": iterations_to_target(base, target),
        "target_reward": target,
        "token_utilisation": _mean(util),
        "signal_share": _mean(signal),
        "effective_utilisation": _mean(effective),
        "kl_max": max(_finite(r.get("kl_old_new") for r in records), default=None),
        "entropy_curve": [r.get("entropy") for r in records],
        "steps_skipped": summary.get("steps_skipped"),
        "wall_s": round(wall_s, 2),
        "train_s": round(sum(_finite(r.get("seconds") for r in records)), 2),
    }
    judge = judge_config(monitor_cfg, records)
    out["entropy_band"] = list(judge.entropy_band) if judge.entropy_band else None
    out.update(collapse_verdict(records, judge, out["stop_reason"]))
    return out
