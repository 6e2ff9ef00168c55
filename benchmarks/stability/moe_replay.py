"""The pre-registered reading of `moe-routing-replay.md`: GRPO and the default DPCC, each with routing
replay off and on, on the mixture-of-experts testbed (grid `moe-addition`).

    python -m benchmarks.stability.moe_replay --out runs/moe_heldout [--collapse-lr 0.002] [--safe-lr 0.0002]
    python -m benchmarks.stability.moe_replay --out benchmarks/stability/moe-routing-replay.jsonl.xz

Replay-on runs are the runner's `--set rollout.routing_replay=true` variants, so their method names are
``grpo[rollout.routing_replay=True]`` and ``dpcc[rollout.routing_replay=True]``. Prints markdown:
- per arm (method x replay) and LR: collapses (95% Wilson CI), final greedy reward (mean, 95% t CI),
  runs ending below their start, the largest in-step KL and the expert load (worst layer);
- paired replay on vs off, per method and LR (same seeds): collapses only with replay / only without
  (exact McNemar p), the paired difference of the final greedy reward (95% t CI), wins/losses (sign p);
- paired DPCC vs GRPO with replay off and with replay on, the same measures;
- the pre-registered claims' verdicts (see the report).
Only complete pairs count in a paired comparison.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from .analyze import _degraded, binom_two_sided, discordant, load_results, mean_ci95, paired, wilson
from .grid import variant_name

METHODS = ("grpo", "dpcc")
#: The development override that turns replay on (the runner's ``--set rollout.routing_replay=true``).
REPLAY = {"rollout.routing_replay": True}
#: Non-inferiority margin of a paired final-reward difference (the stability reports' safe-LR margin).
MARGIN = -0.02


def arm(method: str, replay: bool) -> str:
    """The report's name of one arm."""
    return variant_name(method, REPLAY if replay else None)


def _ci(values) -> str:
    m, lo, hi, n = mean_ci95(values)
    if n == 0:
        return "–"
    return f"{m:+.3f} ({lo:+.3f} to {hi:+.3f})" if n > 1 else f"{m:+.3f}"


def _mean(values, digits: int = 3) -> str:
    v = [x for x in values if x is not None]
    return f"{statistics.fmean(v):.{digits}f}" if v else "–"


def arm_rows(results: list[dict], lrs: list[float]) -> list[dict]:
    """Per LR, method and replay setting: the runs' counts and measures."""
    rows = []
    for lr in lrs:
        for method in METHODS:
            for replay in (False, True):
                rs = [r for r in results if r["method"] == arm(method, replay) and r["lr"] == lr]
                if not rs:
                    continue
                k = sum(bool(r["collapsed"]) for r in rs)
                rows.append({"lr": lr, "method": method, "replay": replay, "n": len(rs), "collapses": k,
                             "ci": wilson(k, len(rs)), "final": [r["reward_after"] for r in rs],
                             "below": sum(_degraded(r) for r in rs), "kl_max": [r.get("kl_max") for r in rs],
                             "moe_entropy": [r.get("moe_load_entropy_mean") for r in rs],
                             "moe_max_over_mean": [r.get("moe_load_max_over_mean_mean") for r in rs]})
    return rows


def arm_table(rows: list[dict]) -> list[str]:
    lines = ["| LR | method | replay | runs | collapsed (95% CI) | final greedy reward (95% CI) | ended below start |"
             " largest in-step KL, mean | expert-load entropy (worst layer), mean | expert max/mean load, mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci"]
        m, flo, fhi, n = mean_ci95(r["final"])
        final = f"{m:.3f} ({flo:.3f}–{fhi:.3f})" if n > 1 else f"{m:.3f}"
        lines.append(f"| {r['lr']:g} | {r['method']} | {'on' if r['replay'] else 'off'} | {r['n']} | "
                     f"{r['collapses']}/{r['n']} = {r['collapses'] / r['n']:.0%} ({lo:.0%}–{hi:.0%}) | {final} | "
                     f"{r['below']}/{r['n']} | {_mean(r['kl_max'])} | {_mean(r['moe_entropy'])} | "
                     f"{_mean(r['moe_max_over_mean'], 2)} |")
    return lines


def compare(results: list[dict], a: str, b: str, lr: float) -> dict:
    """Paired ``a`` vs ``b`` at ``lr``: collapses of each, discordant pairs (exact p), the final greedy
    reward's paired differences a - b, wins/losses (sign p)."""
    pairs = [(x, y) for x, y in paired(results, a, b, [lr])
             if x["reward_after"] is not None and y["reward_after"] is not None]
    only_a, only_b, p = discordant(pairs)
    d = [x["reward_after"] - y["reward_after"] for x, y in pairs]
    wins, losses = sum(v > 0 for v in d), sum(v < 0 for v in d)
    return {"lr": lr, "a": a, "b": b, "pairs": len(pairs), "collapses": (sum(bool(x["collapsed"]) for x, _ in pairs),
                                                                      sum(bool(y["collapsed"]) for _, y in pairs)),
            "only_a": only_a, "only_b": only_b, "p_collapse": p, "d_final": d, "wins": wins, "losses": losses,
            "p_sign": binom_two_sided(wins, wins + losses),
            "below": (sum(_degraded(x) for x, _ in pairs), sum(_degraded(y) for _, y in pairs))}


def compare_table(rows: list[dict], what: str) -> list[str]:
    lines = [f"| LR | {what} | paired seeds | collapsed (first, second) | collapsed only with first / only with "
             "second (exact p) | Δ final greedy reward, first − second (95% CI) | wins/losses (sign p) | "
             "ended below start (first, second) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['lr']:g} | `{r['a']}` vs `{r['b']}` | {r['pairs']} | {r['collapses'][0]}, "
                     f"{r['collapses'][1]} | {r['only_a']} / {r['only_b']} ({r['p_collapse']:.3g}) | "
                     f"{_ci(r['d_final'])} | {r['wins']}/{r['losses']} ({r['p_sign']:.3g}) | "
                     f"{r['below'][0]}, {r['below'][1]} |")
    return lines


def claims(results: list[dict], collapse_lr: float, safe_lr: float) -> list[str]:
    """The pre-registered claims (moe-routing-replay.md), each with its reading and verdict."""
    out = []
    for method in METHODS:  # H1, H2: replay lowers the collapse rate at the collapsing LR
        c = compare(results, arm(method, True), arm(method, False), collapse_lr)
        held = c["pairs"] > 0 and c["only_a"] < c["only_b"] and c["p_collapse"] < 0.05
        out.append(f"- Replay lowers `{method}`'s collapses at lr {collapse_lr:g} (fewer with replay, exact paired "
                   f"p < 0.05): {c['collapses'][0]}/{c['pairs']} with, {c['collapses'][1]}/{c['pairs']} without; "
                   f"discordant {c['only_a']} vs {c['only_b']}, p = {c['p_collapse']:.3g}: "
                   f"**{'holds' if held else 'not shown'}**.")
    for replay in (False, True):  # H3, H4: DPCC's collapse target against GRPO holds on the MoE model
        c = compare(results, arm("dpcc", replay), arm("grpo", replay), collapse_lr)
        k_d, k_g = c["collapses"]
        held = c["pairs"] > 0 and k_d <= k_g / 4 and c["only_a"] < c["only_b"] and c["p_collapse"] < 0.05
        out.append(f"- Replay {'on' if replay else 'off'}: `dpcc` collapses at lr {collapse_lr:g} in at most ¼ of "
                   f"GRPO's runs, exact paired p < 0.05: {k_d}/{c['pairs']} vs {k_g}/{c['pairs']}; discordant "
                   f"{c['only_a']} vs {c['only_b']}, p = {c['p_collapse']:.3g}: **{'holds' if held else 'not shown'}**.")
    for method in METHODS:  # secondary: replay costs nothing at the safe LR (non-inferiority)
        c = compare(results, arm(method, True), arm(method, False), safe_lr)
        m, lo, _hi, n = mean_ci95(c["d_final"])
        held = n > 1 and lo >= MARGIN
        out.append(f"- Replay costs `{method}` no more than {-MARGIN:g} of final greedy reward at lr {safe_lr:g} "
                   f"(95% CI of the paired difference above {MARGIN:g}): {_ci(c['d_final'])}, n = {n}: "
                   f"**{'shown' if held else 'not shown'}**.")
    return out


def report(results: list[dict], collapse_lr: float, safe_lr: float) -> list[str]:
    lrs = sorted({r["lr"] for r in results})
    seeds = sorted({r["seed"] for r in results})
    lines = [f"{len(results)} runs; LRs {', '.join(f'{x:g}' for x in lrs)}; seeds {', '.join(map(str, seeds))}.", "",
             "#### Per arm", "", *arm_table(arm_rows(results, lrs)), "",
             "#### Routing replay on vs off (same method, same seeds)", "",
             *compare_table([compare(results, arm(m, True), arm(m, False), lr) for lr in lrs for m in METHODS],
                            "replay on vs off"), "",
             "#### DPCC vs GRPO (same replay setting, same seeds)", "",
             *compare_table([compare(results, arm("dpcc", rp), arm("grpo", rp), lr) for lr in lrs
                             for rp in (False, True)], "method"), "",
             "#### Pre-registered claims", "", *claims(results, collapse_lr, safe_lr), ""]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="runner folder or export file (FILE#PART for one part)")
    p.add_argument("--collapse-lr", type=float, default=2e-3, help="the pre-registered collapsing LR")
    p.add_argument("--safe-lr", type=float, default=2e-4, help="the pre-registered safe LR")
    args = p.parse_args(argv)
    results, failed = load_results(Path(args.out))
    if not results:
        raise SystemExit(f"no finished runs in {args.out}")
    print("\n".join(report(results, args.collapse_lr, args.safe_lr)))
    if failed:
        print(f"{len(failed)} runs failed and are left out: "
              + ", ".join(f"{r['method']} lr {r['lr']:g} seed {r['seed']}" for r in failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
