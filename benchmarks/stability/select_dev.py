"""Apply a pre-registered development selection rule to candidates of the `dpcc` preset.

    python -m benchmarks.stability.select_dev --out runs/dev_kt_addition --out runs/dev_kt_sorting \
        --candidate incumbent=dpcc --candidate kt-0.02='dpcc[loss.dpcc.drift_lr_rule=kl_target]' ...

The rule (``benchmarks/stability/kl-target-rule.md``): a candidate is eligible when its collapses
at the higher LRs, summed over the testbeds, are at most ``--collapse-ratio`` of the baseline's on
the same runs, and its paired mean final greedy reward minus the baseline's at the safe LR is at
least ``--safe-margin`` on every testbed. Among eligible candidates the highest mean paired
difference over all (testbed, LR) cells wins; candidates within ``--tie`` of the best are tied, and
ties go to the fewest runs ending below their start, then to the first candidate listed (the
incumbent). Only pairs with both runs finished count. Prints a markdown table and the choice.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from .analyze import _degraded, load_results, split_part


def _by_key(results: list[dict]) -> dict[tuple[str, float, int], dict]:
    return {(r["method"], r["lr"], r["seed"]): r for r in results}


def candidate_rows(testbeds: dict[str, list[dict]], candidates: dict[str, str], baseline: str,
                   safe_lr: float) -> list[dict]:
    """Per candidate: collapses at the higher LRs (its own and the baseline's on the same pairs), the
    paired differences per (testbed, LR) cell, and its runs ending below their start."""
    rows = []
    for name, method in candidates.items():
        row = {"name": name, "method": method, "collapses": 0, "baseline_collapses": 0, "below": 0,
               "cells": {}, "pairs": 0}
        for bed, results in testbeds.items():
            runs = _by_key(results)
            for (m, lr, seed), r in sorted(runs.items()):
                base = runs.get((baseline, lr, seed))
                if m != method or base is None:
                    continue
                row["pairs"] += 1
                row["below"] += _degraded(r)
                if lr > safe_lr:
                    row["collapses"] += bool(r["collapsed"])
                    row["baseline_collapses"] += bool(base["collapsed"])
                row["cells"].setdefault((bed, lr), []).append(r["reward_after"] - base["reward_after"])
        rows.append(row)
    return rows


def select(rows: list[dict], safe_lr: float, collapse_ratio: float, safe_margin: float, tie: float) -> dict:
    """Mark each row's eligibility and mean difference; return the chosen row (or None)."""
    for row in rows:
        row["mean_delta"] = statistics.fmean([d for ds in row["cells"].values() for d in ds]) if row["cells"] else None
        safe = {bed: statistics.fmean(ds) for (bed, lr), ds in row["cells"].items() if lr == safe_lr}
        row["safe_delta"] = safe
        row["eligible"] = (row["pairs"] > 0 and row["collapses"] <= collapse_ratio * row["baseline_collapses"]
                           and all(v >= safe_margin for v in safe.values()))
    eligible = [r for r in rows if r["eligible"]]
    if not eligible:
        return {"chosen": None, "tied": []}
    best = max(r["mean_delta"] for r in eligible)
    tied = [r for r in eligible if r["mean_delta"] >= best - tie]
    fewest = min(r["below"] for r in tied)
    chosen = next(r for r in tied if r["below"] == fewest)  # listed order: the incumbent first
    return {"chosen": chosen, "tied": tied}


def table(rows: list[dict], safe_lr: float) -> list[str]:
    beds = sorted({bed for r in rows for bed, _ in r["cells"]})
    lrs = sorted({lr for r in rows for _, lr in r["cells"]})
    cells = [(b, lr) for b in beds for lr in lrs]
    head = ["candidate", "collapsed at higher LRs (baseline)", *[f"Δ {b} {lr:g}" for b, lr in cells],
            "mean Δ", "ended below start", "eligible"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        deltas = [f"{statistics.fmean(r['cells'][c]):+.3f} (n={len(r['cells'][c])})" if c in r["cells"] else "–"
                  for c in cells]
        mean = "–" if r["mean_delta"] is None else f"{r['mean_delta']:+.3f}"
        out.append("| " + " | ".join([r["name"], f"{r['collapses']} ({r['baseline_collapses']})", *deltas, mean,
                                      f"{r['below']}/{r['pairs']}", "yes" if r["eligible"] else "no"]) + " |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", action="append", required=True,
                   help="a testbed's runner folder, export, or FILE#PART of a multi-part export (repeatable)")
    p.add_argument("--candidate", action="append", required=True, metavar="NAME=METHOD",
                   help="a candidate and its method name in the results (variant names include their sets)")
    p.add_argument("--baseline", default="grpo")
    p.add_argument("--safe-lr", type=float, default=2e-4)
    p.add_argument("--collapse-ratio", type=float, default=0.25)
    p.add_argument("--safe-margin", type=float, default=-0.03)
    p.add_argument("--tie", type=float, default=0.01)
    args = p.parse_args(argv)
    candidates = {}
    for item in args.candidate:
        name, sep, method = item.partition("=")
        if not sep:
            p.error(f"--candidate takes NAME=METHOD, got {item!r}")
        candidates[name] = method
    # a testbed is named by its folder, or by its part of a multi-part export (FILE#PART)
    testbeds = {split_part(Path(o))[1] or Path(o).name: load_results(Path(o))[0] for o in args.out}
    rows = candidate_rows(testbeds, candidates, args.baseline, args.safe_lr)
    result = select(rows, args.safe_lr, args.collapse_ratio, args.safe_margin, args.tie)
    print("\n".join(table(rows, args.safe_lr)))
    chosen = result["chosen"]
    print(f"\nchosen: {chosen['name'] if chosen else 'none eligible: the preset stays'}"
          + (f" (tied: {', '.join(r['name'] for r in result['tied'])})" if len(result["tied"]) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
