"""Tables, paired comparisons and plots from the cached results of `run.py`.

    python -m benchmarks.stability.analyze --out runs/stability --results-md benchmarks/stability/RESULTS.md
    python -m benchmarks.stability.analyze --out benchmarks/stability/results.jsonl.xz --results-md /tmp/RESULTS.md

Reads OUT/results/*.json and OUT/manifest.json, writes the markdown report and two PNG
plots next to it. Everything is recomputed from the cached results, so it can run while
the benchmark is still going (the report says how many runs it covers). OUT may also be a
report's export (``--export``: every run's measures and curves, one JSON line each, in one
xz-compressed file; plain or gzip-compressed JSON lines are read too): the tables and plots come
back from it, the manifest's lines (date, machine, commands) do not. A multi-part export holds several
testbeds' (or archived reports') runs in one file, each row keyed by ``part``; ``--part NAME`` (or
``--out FILE#NAME``) tabulates one part:

    python -m benchmarks.stability.analyze --out benchmarks/stability/latched-recovery.jsonl.xz --part onestep \
        --results-md /tmp/onestep/RESULTS.md
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from collections import defaultdict
from pathlib import Path

CLAIMS = {"collapse": (0.23, 0.04), "fewer_steps": 0.37, "utilisation": 2.1}


# ---------------------------------------------------------------- statistics (stdlib only)
def mean_sd(values) -> tuple[float, float, int]:
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return float("nan"), float("nan"), 0
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0), len(v)


def fmt_ms(values, digits: int = 3) -> str:
    m, sd, n = mean_sd(values)
    return "–" if n == 0 else f"{m:.{digits}f} ± {sd:.{digits}f}"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion k/n."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided sign/McNemar test p-value of k successes in n fair trials."""
    if n == 0:
        return 1.0
    pk = [math.comb(n, i) / 2 ** n for i in range(n + 1)]
    return min(1.0, sum(p for p in pk if p <= pk[k] * (1 + 1e-12)))


#: Two-sided 95% Student t quantiles by degrees of freedom (df > 30: the normal quantile).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}


def mean_ci95(values) -> tuple[float, float, float, int]:
    """(mean, low, high, n): the 95% t interval of the mean of paired differences."""
    m, sd, n = mean_sd(values)
    if n < 2:
        return m, float("nan"), float("nan"), n
    h = _T95.get(n - 1, 1.96) * sd / math.sqrt(n)
    return m, m - h, m + h, n


# ---------------------------------------------------------------- loading
#: The file name ``--export`` writes next to a report.
EXPORT = "results.jsonl.xz"


#: The key naming a row's part in a multi-part export (one file for a report's testbeds, or for the archive).
PART = "part"


def export_parts(rows: list[dict]) -> list[str]:
    """The parts of an export's rows, in order of appearance (empty for a one-part export)."""
    return list(dict.fromkeys(r[PART] for r in rows if PART in r))


def read_export(path: Path, part: str | None = None) -> list[dict]:
    """The runs of a report's export: JSON lines, xz- (``.xz``), gzip- (``.gz``) or not compressed. A
    multi-part export (rows keyed by ``part``) needs ``part``: that part's rows, or an error naming the parts."""
    import gzip
    import lzma

    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    parts = export_parts(rows)
    if part is None and parts:
        raise SystemExit(f"{path} holds several parts ({', '.join(parts)}): choose one with --part")
    if part is not None:
        if part not in parts:
            raise SystemExit(f"{path} has no part {part!r} (its parts: {', '.join(parts) or 'none'})")
        rows = [r for r in rows if r.get(PART) == part]
    return rows


def write_export(path: Path, results: list[dict]) -> Path:
    """Every run (rounded, sorted by part, LR, method and seed) as xz-compressed JSON lines: :func:`read_export`'s
    input. Rows carrying ``part`` make a multi-part export."""
    import lzma

    rows = sorted(results, key=lambda r: (r.get(PART, ""), r["lr"], r["method"], r["seed"]))
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as f:
        f.writelines(json.dumps(_rounded(r), sort_keys=True) + "\n" for r in rows)
    return path


def split_part(out: Path, part: str | None = None) -> tuple[Path, str | None]:
    """``FILE#PART`` (a part of a multi-part export, for tools that take several ``--out``) as (FILE, PART)."""
    text = str(out)
    if part is None and "#" in text and not out.exists():
        text, part = text.rsplit("#", 1)
    return Path(text), part


def load_results(out: Path, target: float | None = None, part: str | None = None) -> tuple[list[dict], list[dict]]:
    """Results (ok, failed) cached in a runner folder, or of a report's export file (:func:`read_export`; its
    method names are already the report's; ``part``, or ``FILE#PART``, picks a part of a multi-part export); with
    ``target`` the iterations-to-target are recomputed from the curves."""
    from .grid import variant_name
    from .measures import iterations_to_target

    out, part = split_part(out, part)
    ok, failed = [], []
    if out.is_file():
        rows = read_export(out, part)
    else:
        if part is not None:
            raise SystemExit(f"--part {part}: {out} is a runner folder, not a multi-part export file")
        rows = [json.loads(path.read_text()) for path in sorted((out / "results").glob("*.json"))]
    for r in rows:
        if "[" not in r["method"]:  # a development variant is its own method (an export's are named already)
            r["method"] = variant_name(r["method"], r.get("set"))
    for r in rows:
        if "error" not in r and target is not None:
            r["iters_to_target"] = iterations_to_target(r["reward_base_curve"], target)
            r["target_reward"] = target
        (failed if "error" in r else ok).append(r)
    return ok, failed


def method_order(results: list[dict], preferred: list[str]) -> list[str]:
    present = {r["method"] for r in results}
    return [m for m in preferred if m in present] + sorted(present - set(preferred))


# ---------------------------------------------------------------- tables
def summary_rows(results: list[dict], methods: list[str], lrs: list[float]) -> list[dict]:
    by = defaultdict(list)
    for r in results:
        by[(r["lr"], r["method"])].append(r)
    rows = []
    for lr in lrs:
        for m in methods:
            rs = by.get((lr, m), [])
            if not rs:
                continue
            k = sum(r["collapsed"] for r in rs)
            lo, hi = wilson(k, len(rs))
            rules = defaultdict(int)
            for r in rs:
                if r["collapsed"]:
                    rules[r["collapse_rule"]] += 1
            reached = [r["iters_to_target"] for r in rs if r["iters_to_target"] is not None]
            rows.append({
                "lr": lr, "method": m, "n": len(rs), "collapses": k, "ci": (lo, hi),
                "rules": ", ".join(f"{rule} {c}" for rule, c in sorted(rules.items())) or "–",
                "reached": len(reached), "iters": reached,
                "final": [r["reward_after"] for r in rs], "last5": [r["reward_base_last5"] for r in rs],
                "util": [r["token_utilisation"] for r in rs], "signal": [r["signal_share"] for r in rs],
                "effective": [r.get("effective_utilisation") for r in rs],
                "degraded": sum(_degraded(r) for r in rs),
                "confirmed": sum(r.get("detector_confirmed") is not None for r in rs),
                "wall": [r["wall_s"] for r in rs],
            })
    return rows


def _degraded(r: dict) -> bool:
    """The held-out greedy reward after RL is below the warm-started policy's."""
    before, after = r.get("reward_before"), r.get("reward_after")
    return before is not None and after is not None and after < before


def summary_table(rows: list[dict]) -> list[str]:
    lines = ["| LR | method | runs | collapsed (95% CI) | collapse rule | detector-confirmed | ended below start |"
             " reached target |"
             " iters to target |"
             " final greedy reward | sampled reward, last 5 it. | token utilisation | samples with signal |"
             " effective utilisation | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci"]
        lines.append(
            f"| {r['lr']:g} | {r['method']} | {r['n']} | {r['collapses']}/{r['n']} = {r['collapses'] / r['n']:.0%} "
            f"({lo:.0%}–{hi:.0%}) | {r['rules']} | {r['confirmed']}/{r['n']} | {r['degraded']}/{r['n']} | {r['reached']}/{r['n']} | {fmt_ms(r['iters'], 1)} | "
            f"{fmt_ms(r['final'])} | {fmt_ms(r['last5'])} | {fmt_ms(r['util'])} | {fmt_ms(r['signal'], 2)} | "
            f"{fmt_ms(r['effective'], 2)} | {fmt_ms(r['wall'], 0)} |")
    return lines


def paired(results: list[dict], method: str, baseline: str, lrs=None) -> list[tuple[dict, dict]]:
    """(``method``'s run, ``baseline``'s run) for every (lr, seed) both have, at ``lrs`` (default: all)."""
    idx = {(r["method"], r["lr"], r["seed"]): r for r in results}
    return [(a, idx[(baseline, lr, s)]) for (m, lr, s), a in idx.items()
            if m == method and (lrs is None or lr in lrs) and (baseline, lr, s) in idx]


def discordant(pairs: list[tuple[dict, dict]]) -> tuple[int, int, float]:
    """Pairs collapsed only with the first run, only with the second, and the exact (McNemar) p."""
    only_a = sum(a["collapsed"] and not b["collapsed"] for a, b in pairs)
    only_b = sum(b["collapsed"] and not a["collapsed"] for a, b in pairs)
    return only_a, only_b, binom_two_sided(only_a, only_a + only_b)


def paired_rows(results: list[dict], methods: list[str], lrs: list[float], baseline: str = "grpo") -> list[dict]:
    rows = []
    for lr in lrs:
        for m in methods:
            if m == baseline:
                continue
            pairs = paired(results, m, baseline, [lr])
            if not pairs:
                continue
            only_m, only_b, p_collapse = discordant(pairs)
            d_final = [a["reward_after"] - b["reward_after"] for a, b in pairs
                       if a["reward_after"] is not None and b["reward_after"] is not None]
            d_pass1 = [a["pass1_after"] - b["pass1_after"] for a, b in pairs
                       if a.get("pass1_after") is not None and b.get("pass1_after") is not None]
            wins = sum(d > 0 for d in d_final)
            losses = sum(d < 0 for d in d_final)
            both = [(a["iters_to_target"], b["iters_to_target"]) for a, b in pairs
                    if a["iters_to_target"] is not None and b["iters_to_target"] is not None]
            reach = (sum(a["iters_to_target"] is not None for a, _ in pairs),
                     sum(b["iters_to_target"] is not None for _, b in pairs))
            u_m, _, _ = mean_sd(a["token_utilisation"] for a, _ in pairs)
            u_b, _, _ = mean_sd(b["token_utilisation"] for _, b in pairs)
            e_m, _, _ = mean_sd(a.get("effective_utilisation") for a, _ in pairs)
            e_b, _, _ = mean_sd(b.get("effective_utilisation") for _, b in pairs)
            rows.append({"lr": lr, "method": m, "pairs": len(pairs), "only_m": only_m, "only_b": only_b,
                         "p_collapse": p_collapse,
                         "d_final": d_final, "d_pass1": d_pass1, "wins": wins, "losses": losses,
                         "p_final": binom_two_sided(wins, wins + losses),
                         "steps_ratio": [a / b for a, b in both], "both_reached": len(both), "reach": reach,
                         "util_ratio": u_m / u_b if u_b and math.isfinite(u_b) else float("nan"),
                         "eff_ratio": e_m / e_b if e_b and math.isfinite(e_b) else float("nan")})
    return rows


def paired_table(rows: list[dict], baseline: str = "grpo") -> list[str]:
    lines = [f"| LR | method | paired seeds | collapsed only with method / only with {baseline} (exact p) |"
             f" Δ final greedy reward vs {baseline} | wins/losses (sign p) | Δ final sampled pass@1 vs {baseline} |"
             f" reached target (method, {baseline}) |"
             f" steps ratio when both reached | token utilisation ratio | effective utilisation ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['method']} | {r['pairs']} | {r['only_m']} / {r['only_b']} ({r['p_collapse']:.2f}) | "
            f"{fmt_ms(r['d_final'])} | {r['wins']}/{r['losses']} ({r['p_final']:.2f}) | {fmt_ms(r['d_pass1'])} | "
            f"{r['reach'][0]}, {r['reach'][1]} | {fmt_ms(r['steps_ratio'], 2)} (n={r['both_reached']}) | "
            f"{r['util_ratio']:.2f}× | {r['eff_ratio']:.2f}× |")
    return lines


# ---------------------------------------------------------------- staleness axis (rollout.max_staleness)
#: The config key of the staleness axis: a grid run with ``--set rollout.max_staleness=K`` per K.
STALENESS_KEY = "rollout.max_staleness"


def staleness_of(r: dict) -> int:
    """The run's ``rollout.max_staleness`` k (0, the synchronous loop, when its overrides do not set it)."""
    return int(r.get("overrides", {}).get(STALENESS_KEY, 0) or 0)


def base_method(r: dict) -> str:
    """The run's method with its development overrides except the staleness (the row of the staleness tables)."""
    from .grid import variant_name

    return variant_name(r["method"].split("[", 1)[0], {k: v for k, v in (r.get("set") or {}).items()
                                                       if k != STALENESS_KEY})


def _base_methods(results: list[dict]) -> list[str]:
    """The runs' methods without the staleness, in the runner's method order."""
    from .grid import METHODS

    return method_order([{"method": base_method(r)} for r in results], list(METHODS))


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def cochran_armitage(counts, totals, scores) -> tuple[float, float]:
    """Cochran-Armitage test for a trend in proportions ``counts[i] / totals[i]`` over ``scores[i]``:
    (z, one-sided p for a proportion rising with the score). Without any variance (no group, or every run
    or no run an event) there is no evidence of a trend: (nan, 1.0)."""
    n_all = sum(totals)
    if n_all == 0:
        return float("nan"), 1.0
    p = sum(counts) / n_all
    t = sum(s * (x - n * p) for x, n, s in zip(counts, totals, scores))
    var = p * (1 - p) * (sum(n * s * s for n, s in zip(totals, scores))
                         - sum(n * s for n, s in zip(totals, scores)) ** 2 / n_all)
    if var <= 0:
        return float("nan"), 1.0
    z = t / math.sqrt(var)
    return z, normal_sf(z)


def staleness_rows(results: list[dict], higher: list[float]) -> list[dict]:
    """Per method and k: collapses at the ``higher`` LRs (Wilson CI) and at the others, the mean staleness and
    behaviour KL; per method the trend over k (Cochran-Armitage) and the exact paired test of the largest k
    against k = 0 on the same (LR, seed) at the higher LRs."""
    by = defaultdict(list)
    for r in results:
        by[(base_method(r), staleness_of(r))].append(r)
    rows = []
    for m in _base_methods(results):
        ks = sorted(k for mm, k in by if mm == m)
        cells = []
        for k in ks:
            rs = by[(m, k)]
            hi_runs = [r for r in rs if r["lr"] in higher]
            lo_runs = [r for r in rs if r["lr"] not in higher]
            c = sum(bool(r["collapsed"]) for r in hi_runs)
            cells.append({"k": k, "collapses": c, "n": len(hi_runs), "ci": wilson(c, len(hi_runs)),
                          "safe_collapses": sum(bool(r["collapsed"]) for r in lo_runs), "safe_n": len(lo_runs),
                          "staleness": [r.get("staleness_mean", 0.0 if k == 0 else None) for r in rs],
                          "kl_b": [r.get("kl_behaviour_mean") for r in rs],
                          "not_stale": sum(1 for r in rs if k > 0 and not (r.get("staleness_mean") or 0) > 0)})
        z, p = cochran_armitage([c["collapses"] for c in cells], [c["n"] for c in cells], [c["k"] for c in cells])
        first = {(r["lr"], r["seed"]): r for r in by[(m, ks[0])] if r["lr"] in higher}
        pairs = [(r, first[(r["lr"], r["seed"])]) for r in by[(m, ks[-1])]
                 if r["lr"] in higher and (r["lr"], r["seed"]) in first] if len(ks) > 1 else []
        only_last, only_first, p_pair = discordant(pairs)
        rows.append({"method": m, "cells": cells, "z": z, "p_rise": p, "k_first": ks[0], "k_last": ks[-1],
                     "only_last": only_last, "only_first": only_first, "p_paired": p_pair})
    return rows


def staleness_table(rows: list[dict], higher: list[float]) -> list[str]:
    hi = " + ".join(f"{x:g}" for x in higher)
    lines = [f"| method | k | collapsed at {hi} (95% CI) | collapsed at the other LRs | mean staleness |"
             f" mean kl_b | runs with k ≥ 1 never stale |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for c in row["cells"]:
            lo, up = c["ci"]
            rate = f"{c['collapses']}/{c['n']} = {c['collapses'] / c['n']:.0%} ({lo:.0%}–{up:.0%})" if c["n"] else "–"
            lines.append(f"| {row['method']} | {c['k']} | {rate} | {c['safe_collapses']}/{c['safe_n']} | "
                         f"{fmt_ms(c['staleness'], 2)} | {fmt_ms(c['kl_b'], 3)} | {c['not_stale']} |")
    lines += ["", f"| method | collapses at {hi} by k | trend z (Cochran–Armitage) | one-sided p (rise with k) |"
              " paired: collapsed only at the largest k / only at the smallest (exact p) |",
              "|---|---|---|---|---|"]
    for row in rows:
        z = "–" if math.isnan(row["z"]) else f"{row['z']:+.2f}"
        lines.append(f"| {row['method']} | " + ", ".join(f"{c['collapses']}/{c['n']}" for c in row["cells"])
                     + f" | {z} | {row['p_rise']:.3g} | k={row['k_last']} vs k={row['k_first']}: "
                     f"{row['only_last']} / {row['only_first']} ({row['p_paired']:.3g}) |")
    return lines


def staleness_reward_table(results: list[dict]) -> list[str]:
    """Final greedy reward per method x LR x k (mean ± sd) and its paired difference from the smallest k on the
    same seed (mean, 95% t interval)."""
    by = defaultdict(dict)
    for r in results:
        by[(base_method(r), r["lr"], staleness_of(r))][r["seed"]] = r
    lines = ["| LR | method | k | runs | final greedy reward | Δ vs smallest k, same seed (95% CI) | ended below start |",
             "|---|---|---|---|---|---|---|"]
    methods = _base_methods(results)
    for lr in sorted({r["lr"] for r in results}):
        for m in methods:
            ks = sorted(k for mm, l, k in by if mm == m and l == lr)
            for k in ks:
                rs, ref = by[(m, lr, k)], by[(m, lr, ks[0])]
                finals = [r["reward_after"] for r in rs.values()]
                if k == ks[0]:
                    delta = "–"
                else:
                    mean, lo, hi, n = mean_ci95(rs[s]["reward_after"] - ref[s]["reward_after"] for s in rs
                                                if s in ref and rs[s]["reward_after"] is not None
                                                and ref[s]["reward_after"] is not None)
                    delta = f"{mean:+.3f} ({lo:+.3f} to {hi:+.3f}, n={n})" if n > 1 else "–"
                lines.append(f"| {lr:g} | {m} | {k} | {len(rs)} | {fmt_ms(finals)} | {delta} | "
                             f"{sum(_degraded(r) for r in rs.values())}/{len(rs)} |")
    return lines


def staleness_section(results: list[dict]) -> list[str]:
    """The report's staleness section: collapse by method x k with the trend test, then the final reward."""
    lrs = sorted({r["lr"] for r in results})
    higher = lrs[1:] if len(lrs) > 1 else lrs
    return ["## Collapse by staleness k (same seeds at every k)", "",
            f"Collapse counts over the LRs above the smallest ({', '.join(f'{x:g}' for x in higher)}), 95% Wilson "
            "intervals; the trend test is Cochran–Armitage over k (scores k), one-sided for a rate rising with k; "
            "the paired test compares the largest k with the smallest on the same (LR, seed), exact McNemar. "
            "Mean staleness and kl_b = KL(π_b ‖ π_prox) are the runs' means over their iterations.", "",
            *staleness_table(staleness_rows(results, higher), higher), "",
            "## Final greedy reward by staleness k", "",
            *staleness_reward_table(results), ""]


# ---------------------------------------------------------------- plots
def plot(results: list[dict], methods: list[str], lrs: list[float], rows: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(methods)), 3.5))
    width = 0.8 / max(1, len(lrs))
    for j, lr in enumerate(lrs):
        xs, ys, errs = [], [], []
        for i, m in enumerate(methods):
            row = next((r for r in rows if r["lr"] == lr and r["method"] == m), None)
            if row is None:
                continue
            rate = row["collapses"] / row["n"]
            xs.append(i + j * width)
            ys.append(rate)
            errs.append([[rate - row["ci"][0]], [row["ci"][1] - rate]])
        if xs:
            err = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
            ax.bar(xs, ys, width, yerr=err, capsize=3, label=f"lr {lr:g}")
    ax.set_xticks([i + width * (len(lrs) - 1) / 2 for i in range(len(methods))])
    ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("collapse rate (95% CI)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "collapse_rate.png", dpi=110)
    plt.close(fig)
    names.append("collapse_rate.png")

    fig, axes = plt.subplots(2, len(lrs), figsize=(5.5 * len(lrs), 6.5), squeeze=False)
    for j, lr in enumerate(lrs):
        for m in methods:
            rs = [r for r in results if r["lr"] == lr and r["method"] == m]
            for row, key in ((0, "reward_base_curve"), (1, "entropy_curve")):
                curves = [r[key] for r in rs if r.get(key)]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                # an iteration whose rows were all padding logs no entropy (null): the mean is over the others
                mean = [statistics.fmean(v) if (v := [float(c[i]) for c in curves if c[i] is not None]) else math.nan
                        for i in range(n)]
                style = "-" if not m.startswith("dpcc-") else ":"
                axes[row][j].plot(range(1, n + 1), mean, style, label=m, lw=1.3)
        axes[0][j].set_title(f"lr {lr:g}: sampled rule reward (mean over seeds)", fontsize=9)
        axes[1][j].set_title(f"lr {lr:g}: token entropy (mean over seeds)", fontsize=9)
        axes[1][j].set_xlabel("iteration")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=80)
    plt.close(fig)
    names.append("curves.png")
    return names


# ---------------------------------------------------------------- report
def claims_paragraph(summary: list[dict], paired: list[dict], lrs: list[float],
                     methods: tuple[str, ...] = ("dpcc",)) -> list[str]:
    """The published claims against GRPO, for DPCC as specified and any improved variant in ``methods``."""
    def rate(method, lr=None):
        rs = [r for r in summary if r["method"] == method and (lr is None or r["lr"] == lr)]
        n = sum(r["n"] for r in rs)
        return (sum(r["collapses"] for r in rs), n)

    lines = []
    for method in methods:
        (g_k, g_n), (d_k, d_n) = rate("grpo"), rate(method)
        if not (g_n and d_n):
            continue
        lines.append(f"- **Collapse rate, `{method}`** (claim: {CLAIMS['collapse'][0]:.0%} → "
                     f"{CLAIMS['collapse'][1]:.0%}). Over all learning rates: GRPO {g_k}/{g_n} = {g_k / g_n:.0%}, "
                     f"`{method}` {d_k}/{d_n} = {d_k / d_n:.0%}. "
                     + " ".join(f"At lr {lr:g}: GRPO {rate('grpo', lr)[0]}/{rate('grpo', lr)[1]}, "
                                f"`{method}` {rate(method, lr)[0]}/{rate(method, lr)[1]}." for lr in lrs
                                if rate("grpo", lr)[1] and rate(method, lr)[1]))
        for r in paired:
            if r["method"] != method:
                continue
            ratio, _, n = mean_sd(r["steps_ratio"])
            steps = (f"mean steps ratio {ratio:.2f} over the {n} seed{'s' if n > 1 else ''} where both reached the target, "
                     f"i.e. {1 - ratio:+.0%} fewer steps" if n else "no seed where both reached the target")
            lines.append(f"  - Steps to the same performance at lr {r['lr']:g} (claim: {CLAIMS['fewer_steps']:.0%} "
                         f"fewer): {steps}; reached by `{method}` in {r['reach'][0]}/{r['pairs']}, "
                         f"by GRPO in {r['reach'][1]}/{r['pairs']} seeds.")
            lines.append(f"  - Sample utilisation at lr {r['lr']:g} (claim: {CLAIMS['utilisation']}×): token "
                         f"utilisation ratio {r['util_ratio']:.2f}×, effective utilisation ratio "
                         f"{r['eff_ratio']:.2f}×.")
    return lines


def targets_lines(results: list[dict], method: str, baseline: str = "grpo", margin: float = 0.02) -> list[str]:
    """The new default's targets, each stated as met or not met, with the numbers behind it.

    Collapse: over every LR but the smallest (medium and aggressive), ``method``'s collapse rate is
    at most a quarter of ``baseline``'s, with an exact paired (McNemar) p < 0.05. Safe LR (the
    smallest): paired mean difference of the final greedy reward >= -margin (95% t interval shown).
    Fewer seeds ending below their start than ``baseline``, and a lower collapse rate than every
    other method in the results."""
    lrs = sorted({r["lr"] for r in results})
    if len(lrs) < 2 or not any(r["method"] == method for r in results):
        return [f"- Not evaluated: needs `{method}` and `{baseline}` at two or more learning rates."]
    safe, higher = lrs[0], lrs[1:]
    pairs = paired(results, method, baseline, higher)
    k_m, k_b, n = sum(a["collapsed"] for a, _ in pairs), sum(b["collapsed"] for _, b in pairs), len(pairs)
    only_m, only_b, p = discordant(pairs)
    ok = n > 0 and k_m <= k_b / 4 and p < 0.05 and only_b > only_m
    verdict = lambda met: "**met**" if met else "**not met**"  # noqa: E731
    out = [f"- Collapse at lr {', '.join(f'{x:g}' for x in higher)} (target: ≤ ¼ of {baseline}'s, exact paired "
           f"p < 0.05): `{method}` {k_m}/{n}, {baseline} {k_b}/{n}; discordant pairs {only_m} vs {only_b}, "
           f"p = {p:.3g}: {verdict(ok)}."]
    def safe_diffs(key: str) -> list[float]:  # paired method - baseline differences of ``key`` at the safe LR
        return [a[key] - b[key] for a, b in paired(results, method, baseline, [safe])
                if a.get(key) is not None and b.get(key) is not None]

    d = safe_diffs("reward_after")
    mean, lo, hi, nd = mean_ci95(d)
    out.append(f"- Final greedy reward at lr {safe:g} (target: paired mean difference ≥ −{margin}): "
               f"{mean:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}, {nd} seeds): "
               f"{verdict(nd > 0 and mean >= -margin)}"
               + (" (the CI's lower bound is also above the margin)." if nd > 1 and lo >= -margin else "."))
    d1 = safe_diffs("pass1_after")
    if d1:  # not a target: the same prompts, sampled instead of greedy
        m1, lo1, hi1, n1 = mean_ci95(d1)
        out.append(f"  - Not a target, for reading the one above: the final sampled pass@1 on the same held-out "
                   f"prompts, paired difference {m1:+.3f} (95% CI {lo1:+.3f} to {hi1:+.3f}, {n1} seeds).")
    below = {x: sum(1 for r in results if r["method"] == x and r["reward_after"] is not None
                    and r.get("reward_before") is not None and r["reward_after"] < r["reward_before"])
             for x in (method, baseline)}
    total = {x: sum(1 for r in results if r["method"] == x) for x in (method, baseline)}
    out.append(f"- Runs ending below their starting reward (target: fewer than {baseline}): `{method}` "
               f"{below[method]}/{total[method]}, {baseline} {below[baseline]}/{total[baseline]}: "
               f"{verdict(below[method] < below[baseline])}.")
    rate = {}
    for r in results:
        if r["lr"] in higher:
            k, t = rate.get(r["method"], (0, 0))
            rate[r["method"]] = (k + bool(r["collapsed"]), t + 1)
    # every other method, the paper preset included; the default's own ablations and full-system arm are not rivals
    others = {m: kt for m, kt in rate.items()
              if m != method and not m.startswith(method + "-no-") and m != method + "-full-system"}
    mine = rate.get(method, (0, 0))
    beaten = all(mine[0] / max(mine[1], 1) < k / max(t, 1) for k, t in others.values())
    out.append(f"- Collapse rate at lr {', '.join(f'{x:g}' for x in higher)} against every other method "
               f"(target: lowest): `{method}` {mine[0]}/{mine[1]}; "
               + ", ".join(f"{m} {k}/{t}" for m, (k, t) in sorted(others.items())) + f": {verdict(beaten)}.")
    # The wording: "beats the other baselines". Its variants (dpcc-*) are not baselines; the paper
    # preset, the method as specified, is one.
    rivals = {m: kt for m, kt in others.items() if not m.startswith("dpcc") or m == "dpcc-paper"}
    if rivals != others:
        beats = all(mine[0] / max(mine[1], 1) < k / max(t, 1) for k, t in rivals.values())
        out.append(f"  - Against the baselines only (the issue's wording; the other DPCC variants left out): "
                   + ", ".join(f"{m} {k}/{t}" for m, (k, t) in sorted(rivals.items())) + f": {verdict(beats)}.")
    return out


def machine() -> str:
    import os

    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = "?"
    try:
        from importlib.metadata import version
        mv = version("megatron-core")
    except Exception:
        mv = "?"
    return (f"{platform.platform()}, {os.cpu_count()} CPU cores ({cpu_kind()}), Python {platform.python_version()}, "
            f"torch {tv}, megatron-core {mv}")


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The CPU's model name and the vector extensions torch's CPU kernels choose between: runs are
    bit-reproducible on one machine, but another instruction set changes the floating-point results."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                platform.processor() or "unknown CPU")
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))
    isa = [label for flag, label in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
                                     ("amx_tile", "AMX")) if flag in flags]
    return f"{name}; {', '.join(isa) or 'no AVX2'}"


def _commands(manifest: dict) -> list[str]:
    cmds = manifest.get("commands") or ([manifest["command"]] if manifest.get("command") else [])
    return cmds or ["python -m benchmarks.stability.run"]


def _rounded(obj):
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items() if k != "log_tail"}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def _testbed_words(manifest: dict) -> str:
    """The model and task of the manifest's testbed, in words."""
    from .grid import build_config

    cfg = build_config(manifest.get("testbed") or {})
    m, d, r, t = cfg["model"], cfg["data"], cfg["rollout"], cfg["train"]
    steps = r["prompts_per_iteration"] * r["group_size"] // t["mini_batch_size"]
    what = (f"{d['synthetic_digits']}-digit addition" if d["synthetic_task"] == "addition"
            else f"sorting {d['synthetic_digits']} one-digit numbers")
    return (f"a Megatron-Core GPT ({m['num_layers']} layers, hidden {m['hidden_size']}) with the character "
            f"tokenizer, the synthetic task {what} ({r['prompts_per_iteration']} prompts × {r['group_size']} "
            f"samples, at most {r['max_new_tokens']} new tokens, {steps} Adam step{'s' if steps > 1 else ''} "
            "per iteration)")


def budget_lines(manifest: dict, results: list[dict], full_runs: int) -> list[str]:
    """Measured throughput of the recorded runner sessions and the full grid's time at that rate."""
    sessions = [x for x in manifest.get("sessions", []) if x.get("runs")]
    walls = [r["wall_s"] for r in results if r.get("wall_s")]
    out = [f"- Compute: the {len(walls)} runs took {sum(walls) / 3600:.2f} h of run wall time in all "
           f"({sum(walls) / len(walls):.0f} s per run on average, one process per run)."] if walls else []
    for jobs in sorted({x["jobs"] for x in sessions}):
        same = [x for x in sessions if x["jobs"] == jobs]
        runs, secs = sum(x["runs"] for x in same), sum(x["seconds"] for x in same)
        out.append(f"- Measured throughput with `--jobs {jobs}` on {same[-1].get('cpus', '?')} CPUs: {runs} runs "
                   f"in {secs / 60:.1f} min ({secs / runs:.0f} s per run), so the full grid of {full_runs} runs "
                   f"takes about {full_runs * secs / runs / 60:.0f} min plus the ~1 min warm-start.")
    return out


def _testbed_title(manifest: dict) -> str:
    """The task and its difficulty, from the manifest's testbed ('sorting, 3', 'addition, 1')."""
    from .grid import TASKS

    bed = manifest.get("testbed") or {}
    task = bed.get("data.synthetic_task", "addition")
    return f"{task}, difficulty {bed.get('data.synthetic_digits', TASKS.get(task, {}).get('digits', '?'))}"


def write_report(out: Path, md_path: Path, notes: Path | None = None, target: float | None = None,
                 export: bool = False, targets_of: tuple[str, ...] = (), part: str | None = None) -> Path:
    from .grid import GRIDS, IMPROVED_VARIANT, METHODS, PAPER_VARIANT
    from .measures import BAND

    full_grid = GRIDS["full"]
    results, failed = load_results(out, target, part)
    if not results:
        raise SystemExit(f"no results under {out / 'results'}: run `python -m benchmarks.stability.run` first")
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else {}
    methods = method_order(results, list(METHODS))
    lrs = sorted({r["lr"] for r in results})
    seeds = sorted({r["seed"] for r in results})
    summary = summary_rows(results, methods, lrs)
    paired = paired_rows(results, methods, lrs)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    pngs = plot(results, methods, lrs, summary, md_path.parent)
    same_testbed = (manifest.get("iterations", full_grid.iterations) == full_grid.iterations
                    and manifest.get("testbed", full_grid.extra) == full_grid.extra)
    full = len(full_grid.runs()) if same_testbed else None  # "partial" only against the full grid's own testbed
    status = (f"**Partial run: {len(results)} of the {full} runs of the full grid.**" if full and len(results) < full
              else f"{len(results)} runs.")
    target = results[0].get("target_reward")
    lines = [
        f"# Stability benchmark: {', '.join(methods)} (miniature, CPU{', ' + _testbed_title(manifest) if manifest else ''})",
        "",
        status + f" Methods: {', '.join(methods)}. Learning rates: {', '.join(f'{x:g}' for x in lrs)}. "
        f"Seeds: {', '.join(map(str, seeds))} (paired: every method sees the same seeds)."
        + (f" {len(failed)} runs failed and are excluded: "
           + ", ".join(f"{r['method']} lr {r['lr']:g} seed {r['seed']}" for r in failed) + "." if failed else ""),
        "",
        f"- Date of the analysis: {manifest.get('analysis_date') or __import__('datetime').date.today()}; "
        f"runs started {manifest.get('started', '?')}.",
        f"- Machine: {manifest.get('machine') or machine()}.",
        "- Commands: " + ", then ".join(f"`{c}`" for c in _commands(manifest))
        + f", then `python -m benchmarks.stability.analyze --out {manifest.get('out', out)}"
        + (f" --part {part}" if part else "") + "`.",
        f"- Full grid ({len(full_grid.methods)} methods × {len(full_grid.lrs)} LRs × {len(full_grid.seeds)} seeds = "
        f"{len(full_grid.runs())} runs): `python -m benchmarks.stability.run --grid full --out runs/stability "
        "--jobs 2` (resumable: rerun the same command after an interruption).",
        *budget_lines(manifest, results, len(full_grid.runs())),
        "",
        "## Setup", "",
        f"The real stack: `dpcc-megatron train` (one process, TP=1) on {_testbed_words(manifest)}, "
        f"{manifest.get('warm_start', {}).get('steps', '?')} supervised warm-start steps shared by every run, then "
        f"{manifest.get('iterations', '?')} RL iterations. "
        "The baselines use the rule reward only and no drift-aware LR (`dapo` with dynamic sampling); `dpcc` is the "
        "calibrated default (`loss.dpcc.preset: calibrated`, contrastive track gated on rule spread) and `dpcc-paper` "
        "the literal specification (`loss.dpcc.preset: paper`, ungated dual-track reward): the dual-track reward, "
        "the adaptive τ, the early phase and the drift-aware LR (all defaults). A run collapsed by the written "
        "rule on its curves that also labels the monitor's labelled set (`benchmarks/monitor/labels.py`): the "
        "rule-track reward (3-iteration trailing mean) fell below half its best for good, or the entropy stayed "
        f"outside {BAND[0]}× to {BAND[1]}× the warm-started policy's (iteration 1, before any update) for 5 "
        "iterations with the reward no better than at the start, or the trainer stopped on non-finite steps. "
        "'Detector-confirmed' counts the runs on which the monitor's collapse detector (`run_detector`, shipped "
        "defaults) confirmed a critical alert, as it would advise rollback in training; the detector "
        "only judges: no sidecar runs, so no advice reaches the trainer. Target: sampled rule reward (3-iteration moving "
        f"mean) ≥ {target}. 'Final greedy reward' is the trainer's held-out greedy rule reward after RL "
        "(the warm-started policy's value depends on the seed's held-out prompts); 'ended below start' counts runs "
        "whose final greedy reward is below that starting value, collapsed or not. Token utilisation is the trainer's `sample_utilization` (share of tokens with a "
        "nonzero advantage whose gradient is nonzero), averaged over iterations that had any such token; "
        "'samples with signal' is 1 − the zero-variance group share; 'effective utilisation' is their product per "
        "iteration (the share of all sampled tokens that pushed the policy), averaged over all iterations.",
        "",
        "## Results (mean ± standard deviation over seeds)", "",
        *summary_table(summary), "",
    ]
    if len({staleness_of(r) for r in results}) > 1:  # a staleness grid: each method is read across k, not vs GRPO
        lines += [*staleness_section(results), *[f"![{p}]({p})" for p in pngs], ""]
    else:
        lines += [
            "## Paired comparison with GRPO (same seeds)", "",
            *paired_table(paired), "",
            *[f"![{p}]({p})" for p in pngs], "",
            *[line for m in (targets_of or (IMPROVED_VARIANT,))
              for line in (f"## Targets of the default (`{m}`)" if m == IMPROVED_VARIANT else
                           f"## The default's targets, read for `{m}`", "", *targets_lines(results, m), "")],
            "## Against the published claims", "",
            *claims_paragraph(summary, paired, lrs, (PAPER_VARIANT, IMPROVED_VARIANT)), "",
        ]
    if export:
        path = write_export(md_path.parent / EXPORT, results + failed)
        lines += [f"Every run's measures and curves: [`{path.name}`]({path.name}) (xz-compressed JSON lines; "
                  f"`python -m benchmarks.stability.analyze --out {path.name}` rebuilds the tables from it).", ""]
    if notes is not None and notes.is_file():
        lines += ["## Interpretation", "", notes.read_text().strip(), ""]
    md_path.write_text("\n".join(lines))
    return md_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/stability", help="the runner's output directory, or a report's export file")
    p.add_argument("--results-md", default="benchmarks/stability/RESULTS.md", help="report to write")
    p.add_argument("--notes", default=None, help="markdown file appended as the interpretation section")
    p.add_argument("--target", type=float, default=None,
                   help="target sampled rule reward for 'iterations to target' (default: the grid's)")
    p.add_argument("--export", action="store_true", help=f"also write {EXPORT} (every run) next to the report")
    p.add_argument("--targets-of", action="append", default=[], metavar="METHOD",
                   help="read the default's targets for this method (repeatable; default: dpcc)")
    p.add_argument("--part", default=None,
                   help="the part (testbed, or archived report) of a multi-part export to tabulate; also --out FILE#PART")
    args = p.parse_args(argv)
    out, part = split_part(Path(args.out), args.part)
    path = write_report(out.resolve(), Path(args.results_md), Path(args.notes) if args.notes else None,
                        args.target, args.export, tuple(args.targets_of), part)
    print(f"[stability] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
