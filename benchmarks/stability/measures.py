"""Per-run measures from the trainer's outputs (pure Python).

A run *collapsed* by the written rule on its reward and entropy curves that also labels the
monitor's labelled set (:func:`benchmarks.monitor.labels.label_stream`): the rule-track reward
halved for good (``reward_halved``), or the entropy left the band [0.4, 2.0] x the warm-started
policy's for 5 iterations while the reward was no better than at the start (``entropy_band``), or
the trainer stopped on non-finite steps (``non_finite``). The iteration is the rule's onset.

The monitor's collapse detector is not the judge: it reads the KL, so a method that measures its
drift more often (DPCC's post-step probe) or runs at a larger but stable step would be called
collapsed for its KL alone. What the detector confirms on each run is still reported
(``detector_confirmed``, ``alerts_by_rule``), as the monitor would act on it in training.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from benchmarks.monitor.labels import BAND, label_stream
from dpcc_megatron.monitor.detector import run_detector
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


def collapse_verdict(records: list[dict], monitor_cfg, stop_reason: str = "") -> dict:
    """The run's verdict by the curve rule (see the module docstring), plus what the detector
    (``monitor_cfg``) raised over ``records``."""
    label = label_stream(records, stop_reason) if records else {"label": "collapse", "onset": 0, "halves": None,
                                                                 "entropy_collapse": None}
    alerts = run_detector(records, monitor_cfg)
    fired: dict[str, int] = {}
    for a in alerts:
        fired[a.rule] = fired.get(a.rule, 0) + 1
    confirmed = [a for a in alerts if a.confirmed]
    verdict = {"collapsed": label["label"] == "collapse", "collapse_rule": None, "collapse_iteration": None,
               "alerts_by_rule": fired,
               # what the product's own rules confirm (these would trigger a rollback in training)
               "detector_confirmed": confirmed[0].rule if confirmed else None,
               "detector_confirmed_iteration": confirmed[0].iteration if confirmed else None,
               "first_alert": ({"rule": alerts[0].rule, "severity": alerts[0].severity,
                                "iteration": alerts[0].iteration} if alerts else None)}
    if verdict["collapsed"]:
        onset = label["onset"]
        rule = ("reward_halved" if onset == label["halves"] else
                "entropy_band" if onset == label["entropy_collapse"] else "non_finite")
        verdict["collapse_rule"], verdict["collapse_iteration"] = rule, onset
    return verdict


def final_branch(records: list[dict]) -> list[dict]:
    """The records of the iterations that made the final weights. After a rollback the trainer
    logs iterations again from the checkpoint it went back to; the abandoned ones are dropped."""
    kept: list[dict] = []
    for r in records:
        it = int(r["iteration"])
        while kept and int(kept[-1]["iteration"]) >= it:
            kept.pop()
        kept.append(r)
    return kept


def moe_measures(records: list[dict]) -> dict:
    """Expert load of a mixture-of-experts run (nothing for a dense one): the mean over iterations of the
    worst layer's normalised load entropy and of its max/mean load, and the lowest entropy reached."""
    entropy = _finite(r.get("moe_load_entropy") for r in records)
    if not entropy:
        return {}
    return {"moe_load_entropy_mean": _mean(entropy), "moe_load_entropy_min": min(entropy),
            "moe_load_max_over_mean_mean": _mean(r.get("moe_load_max_over_mean") for r in records)}


def run_measures(records: list[dict], summary: dict, monitor_cfg, target: float, wall_s: float,
                 evals: Optional[list[dict]] = None) -> dict:
    """Everything the analysis needs from one run. ``evals`` are the trainer's held-out eval records
    (``eval.jsonl``): the first is the warm-started policy's, the last the final one's. A run that
    rolled back is judged on its final branch (:func:`final_branch`); ``records_discarded`` counts
    the iterations it abandoned."""
    evals = [e for e in (evals or []) if isinstance(e.get("pass_at_1"), (int, float))]
    logged = len(records)
    records = final_branch(records)
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
        # the same held-out prompts, sampled at the rollout temperature: the share of correct samples
        "pass1_before": evals[0]["pass_at_1"] if evals else None,
        "pass1_after": evals[-1]["pass_at_1"] if len(evals) > 1 else None,
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
        "rollbacks": summary.get("rollbacks", 0),
        "records_discarded": logged - len(records),
        "wall_s": round(wall_s, 2),
        "train_s": round(sum(_finite(r.get("seconds") for r in records)), 2),
    }
    if any("staleness_mean" in r for r in records):  # rollout.max_staleness >= 1: how stale the batches were
        out["staleness_mean"] = _mean(r.get("staleness_mean") for r in records)
        out["kl_behaviour_mean"] = _mean(r.get("kl_behaviour") for r in records)
    judge = judge_config(monitor_cfg, records)
    out["entropy_band"] = list(judge.entropy_band) if judge.entropy_band else None
    out.update(collapse_verdict(records, judge, out["stop_reason"]))
    out.update(moe_measures(records))
    return out
