"""Calibrate the collapse detector on DEVELOPMENT streams (never a held-out part not yet read).

    python -m benchmarks.monitor.calibrate --labelled benchmarks/monitor/labelled [--top 15]
    python -m benchmarks.monitor.calibrate --read benchmarks/monitor/labelled --read DIR ... [--grid one-step --base JSON]

Replays every development stream through the product's detector (``monitor/evaluate.py``) for each
setting of a small grid of detector parameters (:data:`GRIDS`, on top of the shipped defaults and
``--base``), prints the scores of the best settings and the documented defaults from before the
calibration (:data:`BEFORE`), and the setting it would choose (:func:`rank`): among those with at
most 2 warnings per 100 healthy dev iterations, the largest Youden index J = recall - the share of
healthy streams with a confirmed critical alert, then a median lead of at least 3 iterations, then
the most cautious. ``--labelled DIR`` reads DIR's ``dev`` split; ``--read DIR`` reads every stream
of DIR as development: a part that was read once as held out and has joined development. The
streams of all folders are pooled. There is no option to read a held-out part here: report that
with ``dpcc-megatron monitor evaluate --labelled DIR``.

Grids: ``main`` (the band, confirmation, patience, mastered gain and the KL thresholds) and
``one-step`` (``kl_one_step_factor``, the KL thresholds' factor for one-step iterations, searched on
streams of one optimizer step per iteration with the after-step KL; ``--base`` holds the ``main``
choice), as fixed by ``benchmarks/monitor/RESULTS.md#fifth-calibration``; ``sixth`` (the ``reward_drop``
rule's fraction, patience and window, or off, with the one-step factor re-read), as fixed by
``benchmarks/monitor/RESULTS.md#sixth-calibration``; ``seventh`` (a second signal ``reward_drop`` waits for: the held-out
evaluation or the in-group answer diversity, or none), as fixed by ``benchmarks/monitor/RESULTS.md#seventh-calibration``;
``eighth`` (a critical on the KL to the reference model, or none; then the smallest warning on it that stays
within 1 warning per 100 healthy iterations of the streams with a reference, :func:`quietest_warning`), as
fixed by ``benchmarks/monitor/RESULTS.md#eighth-calibration``.

Why J and not "no healthy critical, then recall" (the first calibration's rule): on the dev part,
which since the second calibration holds the stability grid's aggressive-LR runs, the runs at
2e-3 whose 20-iteration reward happened not to halve show the same first-update KL runaway
(0.5-2 nats/token) as the ones that collapsed; no setting without a healthy critical then
catches more than a quarter of the collapses. J weighs a missed collapse and a false alarm alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

from dpcc_megatron.config.monitor import MonitorConfig
from dpcc_megatron.monitor.evaluate import labelled_streams, replay, score

#: The detector's documented example thresholds before issue 21's calibration (band calibrated from
#: 20 healthy steps, every low-entropy stretch a warning unless a template collapse, grad_spike 5x).
BEFORE = {"entropy_band_relative": None, "mastered_reward_gain": None, "kl_critical_threshold": None,
          "kl_sustained_threshold": None, "grad_spike_factor": 5.0, "collapse_confirm_steps": 3,
          "low_entropy_patience": 3, "low_entropy_reward_drop": 0.1}
#: The first calibration's defaults (chosen on the first, 19-stream dev part; no sustained-KL rule).
FIRST = {"kl_critical_threshold": 1.0, "kl_sustained_threshold": None}

#: The parameters searched, each with the values tried, per grid.
GRIDS = {
    "main": {
        "entropy_band_relative": [(0.4, 2.0), (0.5, 1.6), (0.6, 1.4)],
        "collapse_confirm_steps": [1, 2],
        "low_entropy_patience": [1, 3],
        "mastered_reward_gain": [0.05, 0.1],
        "kl_critical_threshold": [None, 0.5, 1.0, 2.0],
        "kl_sustained": [None, (0.1, 2), (0.1, 3), (0.2, 2), (0.2, 3), (0.3, 3)],
    },
    "one-step": {"kl_one_step_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]},
    "sixth": {"reward_drop": [None] + [(f, p, w) for w in (1, 3) for f in (0.3, 0.4, 0.5) for p in (1, 2, 3)],
              "kl_one_step_factor": [3.0, 4.0, 6.0]},
    "seventh": {"second_signal": [None] + [("eval", field, f) for field in ("eval_reward_greedy", "eval_reward_sampled")
                                           for f in (0.1, 0.2, 0.3, 0.5)]
                + [("diversity", d) for d in (0.1, 0.2, 0.3)]},
    "eighth": {"kl_ref_critical_threshold": [None, 0.5, 1.0, 2.0, 4.0]},
}

#: The eighth round's warning on the KL to the reference: the smallest of these values whose warnings stay
#: within :data:`REF_WARNING_BUDGET` per 100 healthy iterations of the streams that carry ``kl_ref``.
REF_WARNING_VALUES = (0.25, 0.5, 1.0, 2.0)
REF_WARNING_BUDGET = 1.0


#: The held-out target on the median lead (iterations before the reward halves).
LEAD_TARGET = 3


def settings(grid: dict = GRIDS["main"]):
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        ov = dict(zip(keys, values))
        if "kl_sustained" in ov:
            sustained = ov.pop("kl_sustained")  # (threshold, window) searched together
            ov["kl_sustained_threshold"] = sustained[0] if sustained else None
            if sustained:
                ov["kl_sustained_window"] = sustained[1]
        if "reward_drop" in ov:
            drop = ov.pop("reward_drop")  # (fraction, patience, window) searched together
            ov["reward_drop_fraction"] = drop[0] if drop else None
            if drop:
                ov["reward_drop_patience"], ov["reward_drop_window"] = drop[1], drop[2]
        if "second_signal" in ov:
            second = ov.pop("second_signal")  # reward_drop_confirm with its own parameters
            ov["reward_drop_confirm"] = second[0] if second else None
            if second and second[0] == "eval":
                ov["reward_drop_eval_field"], ov["reward_drop_eval_fraction"] = second[1], second[2]
            elif second:
                ov["reward_drop_diversity_change"] = second[1]
        yield ov


def load_streams(labelled=(), read=(), eval_every: int = 1) -> list[tuple[str, str, list[dict]]]:
    """(name, label, records) of the dev split of each ``labelled`` folder and of every stream of each
    ``read`` folder, parsed once. ``eval_every`` N > 1 keeps the held-out evaluation fields (``eval_*``)
    only on iterations divisible by N: the streams of a run with ``eval.interval`` N."""
    return [(f"{folder}/{name}", label, [thin_evals(r, eval_every) for r in records])
            for folders, split in ((labelled, "dev"), (read, None)) for folder in folders
            for name, label, records in labelled_streams(folder, split)]


def thin_evals(record: dict, every: int) -> dict:
    """``record`` without its ``eval_*`` fields unless its iteration is a multiple of ``every``."""
    if every <= 1 or record.get("iteration", 0) % every == 0:
        return record
    return {k: v for k, v in record.items() if not k.startswith("eval_")}


def score_of(streams, overrides: dict) -> dict:
    cfg = dataclasses.replace(MonitorConfig(), **overrides)
    cfg.validate()
    return score([replay(records, cfg, name, label) for name, label, records in streams])


def feasible(s: dict) -> bool:
    w = s["warnings_per_100_healthy"]
    return w is None or w <= 2.0


def youden(s: dict) -> float:
    """J = recall - share of healthy streams with a confirmed critical alert."""
    return (s["recall"] or 0.0) - (s["healthy_alarmed"] / s["healthy"] if s["healthy"] else 0.0)


def rank(row) -> tuple:
    """Largest J first (rounded to 3 decimals); then whether the median lead reaches the target (3
    iterations); then the most cautious setting (longest confirmation, longest patience, widest band,
    highest KL thresholds or none, the reward-drop rule off or else its largest fraction, longest
    patience and longest window, largest grad-spike factor, smallest reward gain that counts as
    mastering), so the margin against false alarms on runs the dev part does not have is as large as
    the dev part allows; then fewest warnings, longest lead."""
    _, ov, s = row
    lo, hi = ov.get("entropy_band_relative") or (0.0, 99.0)
    kl = ov.get("kl_critical_threshold") or 99.0
    kl_ref = ov.get("kl_ref_critical_threshold") or 99.0
    sus = ov.get("kl_sustained_threshold") or 99.0
    lead = s["median_lead_iterations"]
    # reward_drop's second signal: none holds no alarm back (most cautious); then the larger threshold
    second = (ov.get("reward_drop_confirm") is None, ov.get("reward_drop_eval_fraction", 0) if
              ov.get("reward_drop_confirm") == "eval" else ov.get("reward_drop_diversity_change", 0))
    return (round(youden(s), 3), lead is not None and lead >= LEAD_TARGET, ov.get("collapse_confirm_steps", 0),
            ov.get("low_entropy_patience", 0), hi - lo, kl, kl_ref, sus, ov.get("kl_sustained_window", 0),
            ov.get("reward_drop_fraction") or 1.0, ov.get("reward_drop_patience", 0), ov.get("reward_drop_window", 0),
            ov.get("kl_one_step_factor", 0), second, ov.get("grad_spike_factor", 0), -(ov.get("mastered_reward_gain") or 0.0),
            -(s["warnings_per_100_healthy"] or 0.0), lead or -99)


def quietest_warning(streams, base: dict, key: str = "kl_ref_threshold", values=REF_WARNING_VALUES,
                     budget: float = REF_WARNING_BUDGET, field: str = "kl_ref"):
    """(the smallest of ``values`` for ``key`` whose warnings per 100 healthy iterations stay within ``budget``
    on the streams that carry ``field``, with ``base``; or None when none does, and the scores of each)."""
    carrying = [s for s in streams if any(field in r for r in s[2])]
    scores = {v: score_of(carrying, {**base, key: v}) for v in values}
    quiet = [v for v in values if (scores[v]["warnings_per_100_healthy"] or 0.0) <= budget]
    return (min(quiet) if quiet else None), scores


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--labelled", action="append", default=[], metavar="DIR", help="its dev split (repeatable)")
    p.add_argument("--read", action="append", default=[], metavar="DIR",
                   help="all its streams, a part read once as held out (repeatable)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="main")
    p.add_argument("--base", default="{}", metavar="JSON", help="overrides every setting starts from")
    p.add_argument("--top", type=int, default=12, help="rows of the best settings to print")
    p.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="keep the streams' evaluation fields only every N iterations (eval.interval N)")
    args = p.parse_args(argv)
    if args.eval_every < 1:
        p.error(f"--eval-every must be >= 1, got {args.eval_every}")
    if not args.labelled and not args.read:
        p.error("give at least one --labelled or --read folder")
    known = {f.name for f in dataclasses.fields(MonitorConfig)}
    try:
        base = json.loads(args.base)
    except ValueError as e:
        p.error(f"--base: not JSON: {e}")
    if not isinstance(base, dict) or set(base) - known:
        p.error(f"--base: a JSON object of MonitorConfig fields; unknown: {sorted(set(base) - known)}")
    base = {k: tuple(v) if isinstance(v, list) else v for k, v in base.items()}
    streams = load_streams(args.labelled, args.read, args.eval_every)
    before = {k: v for k, v in BEFORE.items() if k in known}
    rows = [("before", before, score_of(streams, before)),
            ("first", FIRST, score_of(streams, FIRST)),
            ("defaults", {}, score_of(streams, {}))]
    for ov in settings(GRIDS[args.grid]):
        rows.append(("grid", {**base, **ov}, score_of(streams, {**base, **ov})))
    ok = sorted((r for r in rows if r[0] == "grid" and feasible(r[2])), key=rank, reverse=True)
    print(f"{len(streams)} development streams; {len(rows) - 3} settings tried, {len(ok)} meet <= 2 warnings/100")
    fmt = "{:9s} {:>6s} {:>6s} {:>9s} {:>5s} {:>8s} {:>9s} {:>7s}  {}"
    print(fmt.format("", "J", "recall", "precision", "lead", "h.crit", "h.alarmed", "warn%", "overrides"))
    show = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    for name, ov, s in rows[:3] + ok[:args.top]:
        print(fmt.format(name, show(youden(s)), show(s["recall"]), show(s["precision"]),
                         show(s["median_lead_iterations"]), show(s["healthy_critical"]),
                         f"{s['healthy_alarmed']}/{s['healthy']}", show(s["warnings_per_100_healthy"]), json.dumps(ov)))
    best = ok[0] if ok else None
    if best and args.grid == "eighth":  # then the warning below that critical (RESULTS.md#eighth-calibration)
        warning, scores = quietest_warning(streams, best[1])
        for v, s in scores.items():
            print(f"kl_ref_threshold {v:g}: {show(s['warnings_per_100_healthy'])} warnings / 100 healthy iterations "
                  f"of the {s['streams']} streams with kl_ref")
        best = (best[0], {**best[1], "kl_ref_threshold": warning}, score_of(streams, {**best[1], "kl_ref_threshold": warning}))
    print(json.dumps({"chosen": best[1] if best else None, "dev": best[2] if best else None,
                      "defaults_dev": rows[2][2], "first_dev": rows[1][2], "before_dev": rows[0][2]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
