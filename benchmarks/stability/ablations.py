"""Each variant of a method against that method, paired on the same seeds: which pieces matter.

    python -m benchmarks.stability.ablations --out runs/kt_rest [--reference dpcc] [--variants a,b,...] [--control]

For every variant (default: the methods named ``<reference>-...`` in the folder) and the reference,
on the seeds where both finished: collapses at the higher LRs (every LR but the smallest) with the
exact paired (McNemar) p, and per LR the paired mean difference of the final greedy reward (variant
minus reference) with its 95% t interval. A piece "matters" on a measure when the p is below 0.05
or the interval excludes 0 (``benchmarks/stability/archive/kl-target.md#rest-methods``). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .analyze import discordant, load_results, mean_ci95, paired


def ablation_rows(results: list[dict], reference: str, variants: list[str]) -> list[dict]:
    lrs = sorted({r["lr"] for r in results})
    higher = lrs[1:]
    rows = []
    for v in variants:
        pairs = paired(results, v, reference)
        up = [(a, b) for a, b in pairs if a["lr"] in higher]
        only_v, only_r, p = discordant(up)
        row = {"variant": v, "collapsed": (sum(a["collapsed"] for a, _ in up), sum(b["collapsed"] for _, b in up),
                                           len(up)),
               "p": p, "discordant": (only_v, only_r), "delta": {}}
        for lr in lrs:
            d = [a["reward_after"] - b["reward_after"] for a, b in pairs if a["lr"] == lr]
            row["delta"][lr] = mean_ci95(d)
        row["matters"] = row["p"] < 0.05 or any(n > 1 and (lo > 0 or hi < 0) for _, lo, hi, n in row["delta"].values())
        rows.append(row)
    return rows


def complete_seeds(results: list[dict], methods: list[str]) -> set[int]:
    """Seeds on which every method in ``methods`` has a result at every LR of ``results``."""
    lrs = {r["lr"] for r in results}
    have = {(r["method"], r["lr"], r["seed"]) for r in results}
    return {s for s in {r["seed"] for r in results} if all((m, lr, s) in have for m in methods for lr in lrs)}


def table(rows: list[dict], reference: str) -> list[str]:
    lrs = sorted({lr for r in rows for lr in r["delta"]})
    head = (f"| variant | collapsed at {', '.join(f'{x:g}' for x in lrs[1:])}: variant / `{reference}` "
            f"(discordant, exact p) | " + " | ".join(f"Δ greedy at {lr:g} (95% CI)" for lr in lrs) + " | matters? |")
    out = [head, "|" + "---|" * (3 + len(lrs))]
    for r in rows:
        kv, kr, n = r["collapsed"]
        cells = [f"{m:+.3f} ({lo:+.3f} to {hi:+.3f})" if n > 1 else "–" for m, lo, hi, n in
                 (r["delta"][lr] for lr in lrs)]
        out.append(f"| `{r['variant']}` | {kv}/{n} vs {kr}/{n} ({r['discordant'][0]} vs {r['discordant'][1]}, "
                   f"p = {r['p']:.3g}) | " + " | ".join(cells) + f" | {'yes' if r['matters'] else 'no'} |")
    return out


def _below_start(r: dict) -> bool:
    """The run's final greedy reward is below the warm-started policy's."""
    before, after = r.get("reward_before"), r.get("reward_after")
    return isinstance(before, (int, float)) and isinstance(after, (int, float)) and after < before


def control_table(results: list[dict], methods: list[str]) -> list[str]:
    """What the monitor's control did, per method and LR: runs that rolled back, rollbacks, runs
    paused, iterations abandoned by rollbacks (judged out: see ``measures.final_branch``), collapses
    on the final branch, runs whose final greedy reward ended below their start, and the mean wall
    time."""
    out = ["| method | LR | runs | rolled back (rollbacks) | paused | iterations abandoned | collapsed | "
           "ended below start | mean wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        for lr in sorted({r["lr"] for r in results if r["method"] == m}):
            rs = [r for r in results if r["method"] == m and r["lr"] == lr]
            rolled = sum(1 for r in rs if r.get("rollbacks"))
            paused = sum(1 for r in rs if "paused" in (r.get("stop_reason") or ""))
            out.append(f"| `{m}` | {lr:g} | {len(rs)} | {rolled} ({sum(r.get('rollbacks') or 0 for r in rs)}) | "
                       f"{paused} | {sum(r.get('records_discarded') or 0 for r in rs)} | "
                       f"{sum(bool(r['collapsed']) for r in rs)} | {sum(_below_start(r) for r in rs)} | "
                       f"{sum(r['wall_s'] for r in rs) / len(rs):.0f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the runner's output directory, an export, or FILE#PART")
    p.add_argument("--reference", default="dpcc")
    p.add_argument("--variants", default=None, help="comma list (default: <reference>-* in the folder)")
    p.add_argument("--complete-seeds", action="store_true",
                   help="only the seeds on which the reference and every variant finished at every LR "
                        "(an interrupted grid's complete pairs); prints them")
    p.add_argument("--control", action="store_true",
                   help="also what the monitor's control did (rollbacks, pauses, abandoned iterations)")
    args = p.parse_args(argv)
    ok, _ = load_results(Path(args.out))
    variants = (args.variants.split(",") if args.variants else
                sorted({r["method"] for r in ok if r["method"].startswith(args.reference + "-")}))
    if args.complete_seeds:
        seeds = complete_seeds(ok, [args.reference, *variants])
        ok = [r for r in ok if r["seed"] in seeds]
        print(f"complete seeds ({len(seeds)}): {', '.join(map(str, sorted(seeds)))}")
    print("\n".join(table(ablation_rows(ok, args.reference, variants), args.reference)))
    if args.control:
        print()
        print("\n".join(control_table(ok, [args.reference, *variants])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
