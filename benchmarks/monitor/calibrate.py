"""Calibrate the collapse detector on the DEVELOPMENT part of the labelled set (never the held-out).

    python -m benchmarks.monitor.calibrate --labelled benchmarks/monitor/labelled [--top 15]

Replays every dev stream through the product's detector (``monitor/evaluate.py``) for each
setting of a small grid of detector parameters (:data:`GRID`, on top of the shipped defaults),
prints the scores of the best settings and the documented defaults from before the calibration
(:data:`BEFORE`), and the setting it would choose: among those with no confirmed critical alert
on a healthy dev stream and at most 2 warnings per 100 healthy dev iterations, the highest
recall, then a median lead of at least 3 iterations, then the most cautious (:func:`rank`). There is no option to read the
held-out part here: report that with ``dpcc-megatron monitor evaluate --labelled DIR``.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

from dpcc_megatron.config.monitor import MonitorConfig
from dpcc_megatron.monitor.evaluate import evaluate

#: The detector's documented example thresholds before issue 21's calibration (band calibrated from
#: 20 healthy steps, every low-entropy stretch a warning unless a template collapse, grad_spike 5x).
BEFORE = {"entropy_band_relative": None, "mastered_reward_gain": None, "kl_critical_threshold": None, "grad_spike_factor": 5.0,
          "collapse_confirm_steps": 3, "low_entropy_patience": 3, "low_entropy_reward_drop": 0.1}

#: The parameters searched, each with the values tried.
GRID = {
    "entropy_band_relative": [(0.3, 2.5), (0.4, 2.0), (0.5, 1.6), (0.5, 1.4), (0.6, 1.4)],
    "collapse_confirm_steps": [1, 2, 3],
    "low_entropy_patience": [1, 2, 3],
    "mastered_reward_gain": [0.05, 0.1, 0.2],
    "grad_spike_factor": [5.0, 20.0],
    "kl_critical_threshold": [None, 1.0, 2.0],
}


#: The held-out target on the median lead (iterations before the reward halves).
LEAD_TARGET = 3


def settings():
    keys = list(GRID)
    for values in itertools.product(*(GRID[k] for k in keys)):
        yield dict(zip(keys, values))


def score_of(folder, overrides: dict) -> dict:
    cfg = dataclasses.replace(MonitorConfig(), **overrides)
    cfg.validate()
    _, s = evaluate(folder, cfg, "dev")
    return s


def feasible(s: dict) -> bool:
    w = s["warnings_per_100_healthy"]
    return s["healthy_critical"] == 0 and (w is None or w <= 2.0)


def rank(row) -> tuple:
    """Highest recall first; then whether the median lead reaches the target (3 iterations); then the
    most cautious setting (longest confirmation, longest patience, widest band, highest KL runaway
    threshold or none, largest grad-spike factor, smallest reward gain that counts as mastering), so the margin against false alarms on runs the
    dev part does not have is as large as the dev part allows; then fewest warnings, longest lead."""
    _, ov, s = row
    lo, hi = ov.get("entropy_band_relative") or (0.0, 99.0)
    kl = ov.get("kl_critical_threshold") or 99.0
    lead = s["median_lead_iterations"]
    return (s["recall"] or 0.0, lead is not None and lead >= LEAD_TARGET, ov.get("collapse_confirm_steps", 0),
            ov.get("low_entropy_patience", 0), hi - lo, kl, ov.get("grad_spike_factor", 0),
            -(ov.get("mastered_reward_gain") or 0.0),
            -(s["warnings_per_100_healthy"] or 0.0), lead or -99)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--labelled", required=True, metavar="DIR")
    p.add_argument("--top", type=int, default=12, help="rows of the best settings to print")
    args = p.parse_args(argv)
    known = {f.name for f in dataclasses.fields(MonitorConfig)}
    before = {k: v for k, v in BEFORE.items() if k in known}
    rows = [("before", before, score_of(args.labelled, before)),
            ("defaults", {}, score_of(args.labelled, {}))]
    for ov in settings():
        rows.append(("grid", ov, score_of(args.labelled, ov)))
    ok = sorted((r for r in rows if r[0] == "grid" and feasible(r[2])), key=rank, reverse=True)
    print(f"{len(rows) - 2} settings tried on the dev split, {len(ok)} meet 0 healthy criticals and <= 2 warnings/100")
    fmt = "{:9s} {:>6s} {:>9s} {:>5s} {:>8s} {:>7s}  {}"
    print(fmt.format("", "recall", "precision", "lead", "h.crit", "warn%", "overrides"))
    show = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    for name, ov, s in rows[:2] + ok[:args.top]:
        print(fmt.format(name, show(s["recall"]), show(s["precision"]), show(s["median_lead_iterations"]),
                         show(s["healthy_critical"]), show(s["warnings_per_100_healthy"]), json.dumps(ov)))
    best = ok[0] if ok else None
    print(json.dumps({"chosen": best[1] if best else None, "dev": best[2] if best else None,
                      "defaults_dev": rows[1][2], "before_dev": rows[0][2]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
