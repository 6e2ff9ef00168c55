"""Apply the pre-registered viability rule of a candidate testbed to its development runs.

    python -m benchmarks.stability.viability --candidate C1=runs/deep_dev_c1 --candidate C2=runs/deep_dev_c2 ...

The rule (``benchmarks/stability/four-layer-testbed.md``), on GRPO's runs at the safe and the
aggressive LR: (1) no collapse at the safe LR; (2) at the safe LR the final held-out greedy reward
is above its start in at least ``--min-learned`` runs and by ``--min-gain`` on average; (3) no
safe-LR run ends at ``--ceiling`` or above; (4) at the aggressive LR at least ``--min-hurt`` runs
collapse or end below their start. The first viable candidate, in the order given, is chosen; its
target reward is halfway between the mean sampled rule reward of the first iteration at the safe LR
and the mean best 3-iteration moving mean there, rounded down to 0.05. Prints a markdown table and
the choice.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from .analyze import _degraded, load_results
from .measures import moving_mean


def _best_moving_mean(curve: list[float]) -> float:
    means = [v for v in moving_mean(curve) if math.isfinite(v)]  # the "reached target" measure's windows
    return max(means) if means else float("nan")


def assess(results: list[dict], safe_lr: float, aggressive_lr: float, method: str = "grpo", min_learned: int = 3,
           min_gain: float = 0.05, ceiling: float = 0.9, min_hurt: int = 2) -> dict:
    """The four conditions on one candidate's runs, and the target reward its safe-LR runs give."""
    safe = [r for r in results if r["method"] == method and r["lr"] == safe_lr]
    aggr = [r for r in results if r["method"] == method and r["lr"] == aggressive_lr]
    if not safe or not aggr:
        raise ValueError(f"need {method} runs at {safe_lr} and {aggressive_lr}; "
                         f"have {len(safe)} and {len(aggr)}")
    gains = [r["reward_after"] - r["reward_before"] for r in safe]
    conditions = {
        "no_safe_collapse": not any(r["collapsed"] for r in safe),
        "learns": sum(g > 0 for g in gains) >= min_learned and statistics.fmean(gains) >= min_gain,
        "room_left": all(r["reward_after"] < ceiling for r in safe),
        "aggressive_hurts": sum(r["collapsed"] or _degraded(r) for r in aggr) >= min_hurt,
    }
    first = statistics.fmean(r["reward_base_curve"][0] for r in safe)
    best = statistics.fmean(_best_moving_mean(r["reward_base_curve"]) for r in safe)
    return {"seeds": sorted(r["seed"] for r in safe), "safe_collapsed": sum(r["collapsed"] for r in safe),
            "safe_above_start": sum(g > 0 for g in gains), "mean_gain": statistics.fmean(gains),
            "max_after": max(r["reward_after"] for r in safe),
            "aggressive_hurt": sum(r["collapsed"] or _degraded(r) for r in aggr), "aggressive_runs": len(aggr),
            "first_reward": first, "best_moving_mean": best,
            "target": math.floor((first + best) / 2 * 20 + 1e-9) / 20,
            "conditions": conditions, "viable": all(conditions.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", action="append", required=True, metavar="NAME=DIR",
                   help="a candidate and its runner output folder, in the order of preference (repeatable)")
    p.add_argument("--safe-lr", type=float, default=2e-4)
    p.add_argument("--aggressive-lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    print("| candidate | safe-LR collapses | above start (safe) | mean gain (safe) | best final (safe) | "
          "hurt at aggressive LR | viable | target |")
    print("|---|---|---|---|---|---|---|---|")
    chosen = None
    for item in args.candidate:
        name, sep, folder = item.partition("=")
        if not sep:
            p.error(f"--candidate takes NAME=DIR, got {item!r}")
        ok, _failed = load_results(Path(folder))
        try:
            a = assess(ok, args.safe_lr, args.aggressive_lr)
        except ValueError as e:
            print(f"| {name} | {e} | | | | | no | |")
            continue
        failed = [k for k, v in a["conditions"].items() if not v]
        print(f"| {name} | {a['safe_collapsed']}/{len(a['seeds'])} | {a['safe_above_start']}/{len(a['seeds'])} | "
              f"{a['mean_gain']:+.3f} | {a['max_after']:.3f} | {a['aggressive_hurt']}/{a['aggressive_runs']} | "
              f"{'yes' if a['viable'] else 'no (' + ', '.join(failed) + ')'} | {a['target']:.2f} |")
        if a["viable"] and chosen is None:
            chosen = (name, a["target"])
    print(f"chosen: {chosen[0]} (target reward {chosen[1]:.2f})" if chosen else "chosen: none is viable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
