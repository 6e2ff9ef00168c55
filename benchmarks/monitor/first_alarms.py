"""Where the detector's first confirmed critical lands, on healthy streams and on collapses.

    python -m benchmarks.monitor.first_alarms --read benchmarks/monitor/labelled --read DIR ... [-o KEY=V ...]

Replays every stream of the folders (all splits: use it on development data) through the
product's detector with the shipped defaults (``-o monitor-key=value`` changes one), and counts
each alarmed stream once, by its first confirmed critical alert: the rule, whether it came at
iteration 0 or 1 (a first update that ran away) or later, and the stream's optimizer steps per
iteration (``?`` for streams from before records carried it). A diagnosis for the next
calibration round, not a score: ``dpcc-megatron monitor evaluate`` scores.

``--eval-fall F`` also counts, per label, the streams first alarmed at iteration 0 or 1 whose held-out
greedy evaluation (``eval_reward_greedy``, streams evaluated every iteration) fell by at least F of
its first value within the next 3 iterations: whether the evaluation tells a runaway first update
that recovers from one that collapses.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys

from dpcc_megatron.config.monitor import MonitorConfig
from dpcc_megatron.monitor.detector import run_detector
from dpcc_megatron.monitor.evaluate import labelled_streams

EARLY = 1
"""Iterations up to this one count as the first update's."""


def first_alarms(streams, cfg) -> dict[str, collections.Counter]:
    """label -> Counter of (rule, "iteration <= 1" | "later", steps) over the alarmed streams, plus
    ``"streams"``: label -> number of streams."""
    out: dict = {"streams": collections.Counter()}
    for _, label, records in streams:
        out["streams"][label] += 1
        confirmed = [a for a in run_detector(records, cfg) if a.confirmed]
        if not confirmed:
            continue
        a = confirmed[0]
        steps = records[0].get("optimizer_steps", "?") if records else "?"
        when = f"iteration <= {EARLY}" if a.iteration <= EARLY else "later"
        out.setdefault(label, collections.Counter())[(a.rule, when, steps)] += 1
    return out


def early_eval_falls(streams, cfg, fall: float, within: int = 3) -> dict[str, tuple[int, int]]:
    """label -> (streams with an evaluation every iteration first alarmed at iteration <= EARLY, those
    whose ``eval_reward_greedy`` fell by at least ``fall`` x its first value at iterations 1..within)."""
    out: dict[str, list[int]] = {}
    for _, label, records in streams:
        ev = [r.get("eval_reward_greedy") for r in records[:within + 1]]
        if len(ev) < within + 1 or any(v is None for v in ev) or ev[0] <= 0:
            continue
        confirmed = [a for a in run_detector(records, cfg) if a.confirmed]
        if not confirmed or confirmed[0].iteration > EARLY:
            continue
        n = out.setdefault(label, [0, 0])
        n[0] += 1
        n[1] += min(ev[1:]) <= (1 - fall) * ev[0]
    return {k: (v[0], v[1]) for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--read", action="append", required=True, help="a labelled folder (every split is read)")
    p.add_argument("-o", action="append", default=[], metavar="KEY=VALUE", help="a monitor config value")
    p.add_argument("--eval-fall", type=float, default=None, metavar="F",
                   help="also count early-alarmed streams whose greedy evaluation fell by F within 3 iterations")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.o:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    cfg = dataclasses.replace(MonitorConfig(), **overrides)
    cfg.validate()
    streams = [s for folder in args.read for s in labelled_streams(folder, None)]
    counts = first_alarms(streams, cfg)
    for label in ("healthy", "collapse", "degraded"):
        alarmed = counts.get(label, collections.Counter())
        print(f"{label}: {sum(alarmed.values())} of {counts['streams'][label]} streams alarmed; "
              "first confirmed critical:")
        for (rule, when, steps), n in sorted(alarmed.items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][1])):
            print(f"  {n:4d}  {rule}, {when}, {steps} step(s) per iteration")
    if args.eval_fall is not None:
        for label, (n, fell) in sorted(early_eval_falls(streams, cfg, args.eval_fall).items()):
            print(f"{label}: {n} streams evaluated every iteration and first alarmed at iteration <= {EARLY}; "
                  f"the greedy evaluation fell by >= {args.eval_fall:g} within 3 iterations in {fell}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
