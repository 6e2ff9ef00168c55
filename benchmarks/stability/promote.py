"""Read a pre-registered held-out decision: does a candidate replace the incumbent default?

    python -m benchmarks.stability.promote --candidate 'dpcc[loss.dpcc.lr_scale_init=0.25]' \
        --testbed onestep=runs/ho_onestep --testbed addition=runs/ho_addition [--margin deep=-0.03] \
        [--fewer-collapses-on onestep]

The conditions (``benchmarks/stability/latched-recovery.md``), each on the seeds both methods ran:
1. on the ``--fewer-collapses-on`` testbeds: the candidate collapses at the higher LRs in fewer runs
   than the incumbent;
2. on every testbed: its paired mean final greedy reward minus GRPO's at the safe LR is at least the
   testbed's margin (``--margin``, default -0.02);
3. on every testbed: it collapses at the higher LRs in no more runs than the incumbent;
4. on every testbed: it ends below its start in no more runs than the incumbent.
Prints one table row per testbed (with issue 20's collapse-ratio test against GRPO, reported, not a
condition), the conditions and the decision.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .analyze import _degraded, discordant, load_results, mean_ci95, paired


def _collapses(results: list[dict], method: str, lrs: set[float]) -> int:
    return sum(bool(r["collapsed"]) for r in results if r["method"] == method and r["lr"] in lrs)


def summarise_testbed(results: list[dict], candidate: str, incumbent: str, baseline: str = "grpo") -> dict:
    """Counts and paired differences on the (lr, seed) cells all three methods finished."""
    cells = [{(r["lr"], r["seed"]) for r in results if r["method"] == m} for m in (candidate, incumbent, baseline)]
    common = set.intersection(*cells)
    runs = [r for r in results if (r["lr"], r["seed"]) in common]
    lrs = sorted({lr for lr, _ in common})
    if not lrs:
        raise ValueError(f"no (lr, seed) finished by all of {candidate}, {incumbent} and {baseline}")
    safe, higher = lrs[0], set(lrs[1:])
    row = {"seeds": len({s for _, s in common}), "safe_lr": safe}
    for name, m in (("candidate", candidate), ("incumbent", incumbent), ("baseline", baseline)):
        row[f"{name}_collapses"] = _collapses(runs, m, higher)
        row[f"{name}_below"] = sum(_degraded(r) for r in runs if r["method"] == m)
        row[f"{name}_runs"] = sum(r["method"] == m for r in runs)
        pairs = paired(runs, m, baseline, [safe])
        row[f"{name}_safe_delta"] = mean_ci95([a["reward_after"] - b["reward_after"] for a, b in pairs])
        row[f"{name}_vs_baseline"] = discordant(paired(runs, m, baseline, sorted(higher)))
    return row


def decide(rows: dict[str, dict], margins: dict[str, float], fewer_on: set[str]) -> tuple[list[str], bool]:
    """The conditions as (text, holds) lines and whether all hold."""
    out, ok = [], True
    for bed, row in rows.items():
        checks = []
        if bed in fewer_on:
            checks.append((f"{bed}: collapses at the higher LRs fewer than the incumbent's",
                           f"{row['candidate_collapses']} vs {row['incumbent_collapses']}",
                           row["candidate_collapses"] < row["incumbent_collapses"]))
        d, margin = row["candidate_safe_delta"], margins.get(bed, -0.02)
        checks.append((f"{bed}: safe-LR Δ vs GRPO ≥ {margin:+.2f}",
                       f"{d[0]:+.3f} (95% CI {d[1]:+.3f} to {d[2]:+.3f}, n={d[3]})", d[0] >= margin))
        checks.append((f"{bed}: collapses at the higher LRs no more than the incumbent's",
                       f"{row['candidate_collapses']} vs {row['incumbent_collapses']}",
                       row["candidate_collapses"] <= row["incumbent_collapses"]))
        checks.append((f"{bed}: runs ending below start no more than the incumbent's",
                       f"{row['candidate_below']} vs {row['incumbent_below']} of {row['candidate_runs']}",
                       row["candidate_below"] <= row["incumbent_below"]))
        for text, reading, holds in checks:
            out.append(f"| {text} | {reading} | {'yes' if holds else '**no**'} |")
            ok &= holds
    return out, ok


def table(rows: dict[str, dict]) -> list[str]:
    lines = ["| testbed | seeds | collapsed at higher LRs: candidate / incumbent / GRPO | candidate vs GRPO: discordant (exact p) |"
             " ≤ ¼ of GRPO's, p < 0.05 | safe-LR Δ vs GRPO: candidate | incumbent | ended below start: candidate / incumbent / GRPO |",
             "|---|---|---|---|---|---|---|---|"]
    for bed, r in rows.items():
        a, b, p = r["candidate_vs_baseline"]
        quarter = r["candidate_collapses"] <= r["baseline_collapses"] / 4 and p < 0.05
        c, i = r["candidate_safe_delta"], r["incumbent_safe_delta"]
        lines.append(f"| {bed} | {r['seeds']} | {r['candidate_collapses']} / {r['incumbent_collapses']} / "
                     f"{r['baseline_collapses']} | {a} vs {b} ({p:.2g}) | {'met' if quarter else 'not met'} | "
                     f"{c[0]:+.3f} ({c[1]:+.3f} to {c[2]:+.3f}) | {i[0]:+.3f} ({i[1]:+.3f} to {i[2]:+.3f}) | "
                     f"{r['candidate_below']} / {r['incumbent_below']} / {r['baseline_below']} of {r['candidate_runs']} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", required=True, help="the candidate's method name in the results (sets included)")
    p.add_argument("--incumbent", default="dpcc")
    p.add_argument("--baseline", default="grpo")
    p.add_argument("--testbed", action="append", required=True, metavar="NAME=DIR",
                   help="a runner folder, an export, or FILE#PART of a multi-part export")
    p.add_argument("--margin", action="append", default=[], metavar="NAME=VALUE",
                   help="the safe-LR margin of one testbed (default -0.02)")
    p.add_argument("--fewer-collapses-on", action="append", default=[], metavar="NAME")
    args = p.parse_args(argv)
    beds = dict(item.split("=", 1) for item in args.testbed)
    margins = {k: float(v) for k, v in (item.split("=", 1) for item in args.margin)}
    unknown = (set(margins) | set(args.fewer_collapses_on)) - set(beds)
    if unknown:
        p.error(f"not a --testbed: {', '.join(sorted(unknown))}")
    rows = {bed: summarise_testbed(load_results(Path(d))[0], args.candidate, args.incumbent, args.baseline)
            for bed, d in beds.items()}
    print("\n".join(table(rows)))
    lines, ok = decide(rows, margins, set(args.fewer_collapses_on))
    print("\n| condition | reading | holds? |\n|---|---|---|")
    print("\n".join(lines))
    print(f"\ndecision: {'the candidate replaces the default' if ok else 'the default stays'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
