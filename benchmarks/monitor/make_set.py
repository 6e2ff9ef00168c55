"""Build the labelled metric streams the collapse detector is scored on (issue 21).

    python -m benchmarks.monitor.make_set --out runs/monitor_set [--write benchmarks/monitor/labelled]
        [--families stab-safe,ramp] [--jobs 1] [--budget-minutes 0]

Every stream is a real run of the trainer (`dpcc-megatron train`, one process, TP=1) on the
stability benchmark's job (benchmarks/stability/grid.py: the demo's tiny GPT, 1-digit addition,
one shared supervised warm-start), made with that benchmark's runner (`ensure_warm_start`,
`build_config`, `train_once`). Runs are cached under OUT/runs/<family>__<key>/ (a finished run
whose config is unchanged is not trained again), so an interrupted build resumes.

With ``--write DIR`` the streams are labelled (:mod:`benchmarks.monitor.labels`: a written rule
on the reward and entropy curves, never by hand), trimmed to the fields the detector reads, and
written with their labels as one compressed file, DIR/set.tar.xz (members ``labels.jsonl`` and
``streams/*.jsonl``), ready for ``dpcc-megatron monitor evaluate --labelled DIR``
(``tar -xJf DIR/set.tar.xz -C DIR`` unpacks it).

The dev/held-out split is fixed by seed before any tuning (:func:`split_of`): seeds 51-52 are the
held-out part, every other seed is ``dev``. Each held-out part is read once, then joins dev:
- the even seeds 2-6 with the first calibration; seeds 41-42 were then added to every family;
- seeds 41-42 with the second; then the trainer stopped folding DPCC's drift probe into
  ``kl_step_max`` (DPCC streams were trained again), and seeds 43-44 were added to every family and
  trained before the third calibration;
- seeds 43-44 with the third; then the labelling rule gained its ``degraded`` label, the ``dpcc``
  default changed (the KL-target LR rule), every stream was trained again, and seeds 45-46 were added
  to every family before the fourth calibration;
- seeds 45-46 with the fourth (``labelled/labels.jsonl`` now files them under ``dev``, as this
  module writes them; ``benchmarks/monitor/RESULTS.md#fifth-calibration``); seeds 47-48 were then added to
  every family, written with ``--seeds 47,48`` to ``labelled-fifth/``;
- seeds 47-48 with the fifth (``benchmarks/monitor/RESULTS.md#sixth-calibration``); seeds 49-50 were then added
  to every family, written with ``--seeds 49,50`` to ``labelled-sixth/``;
- seeds 49-50 with the sixth (``benchmarks/monitor/RESULTS.md#seventh-calibration``); seeds 51-52 were then added
  to every family, trained with ``--set eval.interval=1`` (an evaluation every iteration, joined into the
  streams as ``eval_*`` fields) and written to ``labelled-seventh/``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from benchmarks.stability.grid import (AGGRESSIVE_LR, BROKEN_LR, GRIDS, SAFE_LR, Grid, build_config, run_key,
                                       run_overrides, steps_per_iteration)
from benchmarks.stability.run import ensure_warm_start, parse_sets, train_once

from dpcc_megatron.monitor.evaluate import PACK, write_pack
from dpcc_megatron.train.evaluate import RECORD_FIELDS

from .labels import label_stream

#: The fields of a trainer record the detector (and the labelling rule) reads; the rest is dropped.
KEEP = ("iteration", "entropy", "kl_old_new", "kl_step_max", "kl_estimator", "kl_ref", "mismatch_kl",
        "repetition_rate", "longest_repeat", "grad_norm", "reward_mean", "reward_std", "zero_var_frac",
        "reward_base_mean", "reward_base_std", "zero_var_frac_base", "optimizer_steps", "answer_distinct_frac")


@dataclass(frozen=True)
class Family:
    """One kind of run: a method at one LR for some seeds, plus overrides."""

    name: str
    method: str
    lr: float
    seeds: tuple[int, ...]
    iterations: int
    why: str
    extra: dict = field(default_factory=dict)

    def grid(self) -> Grid:
        # The first testbed (the stability grid `small`: the demo's 2-layer GPT, 1-digit addition,
        # 2 optimizer steps per iteration, 60 warm-start steps), whatever the stability grid's default.
        return Grid(methods=(self.method,), lrs=(self.lr,), seeds=self.seeds, iterations=self.iterations,
                    warm_start_steps=TESTBED.warm_start_steps, extra={**TESTBED.extra, **self.extra})


#: The stability grid whose testbed (model, task, warm-start) every stream uses.
TESTBED = GRIDS["small"]
#: Seeds of the held-out part (see the module docstring); each family runs them.
HELDOUT_SEEDS = (51, 52)
#: Earlier held-out parts, read once each, now development seeds of every family.
READ_SEEDS = (41, 42, 43, 44, 45, 46, 47, 48, 49, 50)


def _steps(iterations: int) -> int:
    """Optimizer steps of a run of the base job (2 per iteration: 64 samples / mini-batch 32)."""
    return 2 * iterations


FAMILIES: tuple[Family, ...] = (
    # (In build order: what matters most first, for a build its budget stops early.)
    Family("stab-safe", "grpo", SAFE_LR, (1, 2, 3, 4, 5, 6, *READ_SEEDS, *HELDOUT_SEEDS), 20, "stability grid, safe LR"),
    Family("stab-safe", "dpcc", SAFE_LR, (1, 2, 3, 4, *READ_SEEDS, *HELDOUT_SEEDS), 20, "stability grid, safe LR"),
    # Runs that keep going for longer at 2.5x the safe LR (learning runs' entropy falls as the reward rises;
    # whether a run stays healthy is the labelling rule's verdict, not this list's).
    Family("learn", "dpcc", 5e-4, (1, 2, *READ_SEEDS, *HELDOUT_SEEDS), 60, "DPCC at a moderate LR, 60 iterations"),
    Family("learn", "grpo", 5e-4, (3, 4, 5, 6, *READ_SEEDS, *HELDOUT_SEEDS), 40, "GRPO at a moderate LR, 40 iterations"),
    # The high-entropy direction. Very large LRs (below) end near-deterministic on this model; flat
    # logits need the weights to shrink: a decoupled weight decay set ~1000x too large (150 at the safe
    # LR: every weight loses 3% per step) flattens the policy step by step, so entropy climbs and the
    # answers turn random.
    Family("decay", "grpo", SAFE_LR, (1, 2, 3, 4, 5, 6, *READ_SEEDS, *HELDOUT_SEEDS), 30, "weight decay 150 (a scale fault): entropy climbs",
           {"optim.weight_decay": 150.0}),
    # A step size that climbs: a linear LR warm-up to 10x the aggressive LR over the whole run.
    Family("ramp", "grpo", BROKEN_LR, (1, 2, 3, 4, 5, 6, *READ_SEEDS, *HELDOUT_SEEDS), 30, "LR climbing linearly to 10x the aggressive LR",
           {"optim.lr_warmup_iters": _steps(30)}),
    Family("stab-aggr", "grpo", AGGRESSIVE_LR, (1, 2, 3, 4, *READ_SEEDS, *HELDOUT_SEEDS), 20, "stability grid, aggressive LR"),
    Family("stab-aggr", "dpcc", AGGRESSIVE_LR, (1, 2, *READ_SEEDS, *HELDOUT_SEEDS), 20, "stability grid, aggressive LR"),
    # Half the aggressive LR over a longer run: collapses that build up over iterations, if any.
    Family("slow-aggr", "grpo", AGGRESSIVE_LR / 2, (1, 2, *READ_SEEDS, *HELDOUT_SEEDS), 40, "half the aggressive LR, 40 iterations"),
    # The smoke test's broken LR (10x the aggressive one), constant.
    Family("broken", "grpo", BROKEN_LR, (1, 2, *READ_SEEDS, *HELDOUT_SEEDS), 20, "10x the aggressive LR"),
    # Runs meant to master the task: twice the prompts per iteration (a less noisy gradient) at 2.5x the
    # safe LR for 100 iterations, so entropy can fall a long way while the reward rises.
    Family("master", "grpo", 5e-4, (7, *READ_SEEDS, *HELDOUT_SEEDS), 100, "16 prompts per iteration at 2.5x the safe LR, 100 iterations",
           {"rollout.prompts_per_iteration": 16, "rollout.batch_size": 128, "train.mini_batch_size": 64}),
)


def split_of(seed: int) -> str:
    """The split, fixed before tuning: seeds 51-52 are held out, all others develop the detector."""
    return "heldout" if seed in HELDOUT_SEEDS else "dev"


def run_name(fam: Family, seed: int) -> str:
    return f"{fam.name}__{run_key(fam.method, fam.lr, seed)}"


def planned(families=FAMILIES) -> list[tuple[Family, int]]:
    """Seed pairs (1, 2), (3, 4)... one after the other, and within a pair each family's dev run next to
    its held-out run: a build stopped by its budget leaves both splits with the same families."""
    runs = [(f, s) for i, f in enumerate(families) for s in f.seeds]
    order = {id(f): i for i, f in enumerate(families)}
    return sorted(runs, key=lambda r: ((r[1] + 1) // 2, order[id(r[0])], r[1]))


def run_config(fam: Family, seed: int, warm: Path, run_dir: Path, sets: Optional[dict] = None) -> dict:
    """The run's config; ``sets`` (``--set``) apply last, as in the stability runner."""
    overrides = run_overrides(replace(fam.grid(), sets=dict(sets or {})), fam.method, fam.lr, seed)
    return build_config({**overrides, "checkpoint.load": str(warm), "train.output_dir": str(run_dir)})


def is_done(run_dir: Path, cfg: dict) -> bool:
    import yaml

    cfg_path = run_dir / "config.yaml"
    return ((run_dir / "train_summary.json").is_file() and (run_dir / "metrics.jsonl").is_file()
            and cfg_path.is_file() and yaml.safe_load(cfg_path.read_text()) == json.loads(json.dumps(cfg)))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _short(v):
    if isinstance(v, float) and v == v and abs(v) != float("inf"):
        return float(f"{v:.5g}")
    return v


def trim(records: list[dict]) -> list[dict]:
    return [{k: _short(r[k]) for k in KEEP if k in r and r[k] is not None} for r in records]


def read_evals(run_dir: Path) -> dict[int, dict]:
    """Iteration -> ``eval_<field>`` of the run's held-out evaluations (eval.jsonl; none: {}), the fields the
    trainer now puts into records itself (``RECORD_FIELDS``), for runs made before it did. An evaluation at
    iteration i was taken on the weights iteration i's rollouts were sampled from."""
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return {}
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            out[int(e["iteration"])] = {f"eval_{k}": _short(e[k]) for k in RECORD_FIELDS if e.get(k) is not None}
    return out


def with_evals(records: list[dict], evals: dict[int, dict]) -> list[dict]:
    """``records`` with each iteration's evaluation fields joined in."""
    return [{**r, **evals.get(r.get("iteration"), {})} for r in records]


STABILITY_FAMILY = "stab-grid"
_RUN_DIR = re.compile(r"^(?P<method>[a-z0-9_-]+)__lr(?P<lr>[0-9.e+-]+)__s(?P<seed>[0-9]+)(__set-[0-9a-f]+)?$")


def grid_family(testbed: dict, layers: Optional[int] = None) -> str:
    """The family name of a stability grid's runs: its task, difficulty and optimizer steps per iteration,
    and its model's layers when they are not this set's (``layers``)."""
    own = GRIDS["small"].extra.get("model.num_layers")
    return (f"grid-{testbed.get('data.synthetic_task', 'addition')}{testbed.get('data.synthetic_digits', 1)}"
            f"-{steps_per_iteration(testbed)}step" + (f"-{layers}layer" if layers not in (None, own) else ""))


def stability_runs(folder: Path, any_testbed: bool = False) -> list[tuple[str, float, int, Path]]:
    """(method, lr, seed, run dir) of every finished run of a stability-runner output folder whose
    testbed is this set's (:data:`TESTBED`, read from the folder's manifest.json); with ``any_testbed``,
    any task, difficulty, steps per iteration and model."""
    manifest = json.loads((folder / "manifest.json").read_text())
    if not any_testbed and manifest.get("testbed") != TESTBED.extra:
        raise SystemExit(f"{folder}: its testbed {manifest.get('testbed')} is not this set's {TESTBED.extra}")
    out = []
    for run_dir in sorted((folder / "runs").iterdir()):
        m = _RUN_DIR.match(run_dir.name)
        if m and (run_dir / "metrics.jsonl").is_file() and (run_dir / "train_summary.json").is_file():
            out.append((m["method"], float(m["lr"]), int(m["seed"]), run_dir))
    return out


def grid_of(folder: Path) -> tuple[str, dict, str]:
    """A stability-runner output folder's family name, testbed and grid name (from its manifest)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    testbed = manifest.get("testbed") or {}
    layers = (manifest.get("warm_start") or {}).get("model", {}).get("num_layers")
    grid = re.search(r"--grid (\S+)", (manifest.get("commands") or [""])[0])
    # runs trained with a reference model (--set loss.ref_kl_coef=...) form their own family
    ref = any(((sets or {}).get("loss.ref_kl_coef") or 0) > 0 for sets in manifest.get("sets") or [])
    return grid_family(testbed, layers) + ("-ref" if ref else ""), testbed, grid[1] if grid else "small"


def _labelled(run_dir: Path, streams: dict, name: str, split: Optional[str] = None, steps: Optional[int] = None,
              **info) -> Optional[dict]:
    """Trim and label one run's stream, put into ``streams`` (member name -> text). ``steps``: the testbed's
    optimizer steps per iteration, written as ``optimizer_steps`` into records of runs made before the
    trainer recorded it."""
    records = with_evals(trim(read_metrics(run_dir)), read_evals(run_dir))
    if steps is not None:
        records = [r if "optimizer_steps" in r else {**r, "optimizer_steps": steps} for r in records]
    if not records:
        return None
    summary = json.loads((run_dir / "train_summary.json").read_text())
    stream = f"streams/{name}.jsonl"
    streams[stream] = "".join(json.dumps(r) + "\n" for r in records)
    greedy = (summary.get("reward_before"), summary.get("reward_after"))
    lab = label_stream(records, stop_reason=summary.get("stop_reason", ""), greedy=greedy)
    return {"stream": stream, "label": lab.pop("label"), "split": split or split_of(info["seed"]), **lab,
            "greedy_before": greedy[0], "greedy_after": greedy[1],
            "stop_reason": summary.get("stop_reason", ""), **info}


def write_set(out: Path, dest: Path, families=FAMILIES, stability=(), heldout_grids=(), dev_grids=()) -> list[dict]:
    """Label every finished run of ``families`` (and of the stability-runner folders ``stability``, split
    by seed, and ``heldout_grids`` / ``dev_grids``, any testbed, all held out / all dev) and write
    DIR/set.tar.xz (labels.jsonl and streams/)."""
    for loose in (dest / "streams", dest / "labels.jsonl"):  # the reader prefers loose files: they would hide the set
        if loose.exists():
            raise SystemExit(f"{loose}: loose files of an earlier set; remove them or write elsewhere")
    dest.mkdir(parents=True, exist_ok=True)
    labels, streams = [], {}
    for fam, seed in planned(families):
        name = run_name(fam, seed)
        run_dir = out / "runs" / name
        if (run_dir / "metrics.jsonl").is_file():
            labels.append(_labelled(run_dir, streams, name, family=fam.name, method=fam.method, lr=fam.lr, seed=seed,
                                    source="benchmarks/monitor/make_set.py: " + fam.why))
    for folder in stability:
        for method, lr, seed, run_dir in stability_runs(Path(folder)):
            name = f"{STABILITY_FAMILY}__{run_key(method, lr, seed)}"
            labels.append(_labelled(run_dir, streams, name, family=STABILITY_FAMILY, method=method, lr=lr, seed=seed,
                                    source="benchmarks/stability/run.py --grid small"))
    for split, folders in (("heldout", heldout_grids), ("dev", dev_grids)):
        for folder in folders:
            family, testbed, grid = grid_of(Path(folder))
            for method, lr, seed, run_dir in stability_runs(Path(folder), any_testbed=True):
                name = f"{family}__{run_key(method, lr, seed)}"
                labels.append(_labelled(run_dir, streams, name, split=split, steps=steps_per_iteration(testbed),
                                        family=family, method=method, lr=lr, seed=seed,
                                        source=f"benchmarks/stability/run.py --grid {grid} ({family})"))
    labels = [x for x in labels if x is not None]
    write_pack(dest / PACK, streams, labels)
    return labels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/monitor_set", help="run outputs, logs and the warm-start")
    p.add_argument("--write", default=None, metavar="DIR", help="label and write the streams here")
    p.add_argument("--families", default=None, help="comma list of family names (default: all; none: no family)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (one process each, one thread each)")
    p.add_argument("--budget-minutes", type=float, default=0, help="start no new run after this (0: no limit)")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds before one run is killed")
    p.add_argument("--no-train", action="store_true", help="only label and write what is already trained")
    p.add_argument("--seeds", default=None, help="comma list: only the families' runs of these seeds (default: all)")
    p.add_argument("--stability", action="append", default=[], metavar="DIR",
                   help="also label and write the runs of this `benchmarks.stability.run --grid small` output "
                        "folder (family stab-grid; split by seed like the rest)")
    p.add_argument("--heldout-grid", action="append", default=[], metavar="DIR",
                   help="also label and write every run of this stability-runner output folder (any task, "
                        "difficulty, steps per iteration and model) as held out, family "
                        "grid-<task><digits>-<steps>step[-<layers>layer][-ref] (benchmarks/monitor/RESULTS.md#heldout-grids; "
                        "-ref: trained with a reference model)")
    p.add_argument("--dev-grid", action="append", default=[], metavar="DIR",
                   help="the same as --heldout-grid, with every run in the dev split (a grid that was read once "
                        "as held out, or one no held-out reading uses)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override of every family run (dotted config key, repeatable), applied last; use a "
                        "fresh --out, since run folders are named without it (e.g. eval.interval=1)")
    args = p.parse_args(argv)
    try:
        sets = parse_sets(args.set)
    except ValueError as e:
        p.error(f"--set: {e}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    wanted = set(args.families.split(",")) if args.families else None
    families = () if wanted == {"none"} else tuple(f for f in FAMILIES if wanted is None or f.name in wanted)
    if wanted and wanted != {"none"} and not families:
        p.error(f"--families: none of {sorted(wanted)}; known: {sorted({f.name for f in FAMILIES})}")
    if args.seeds:
        try:
            only = {int(x) for x in args.seeds.split(",")}
        except ValueError:
            p.error(f"--seeds: a comma list of integers, got {args.seeds!r}")
        families = tuple(replace(f, seeds=tuple(s for s in f.seeds if s in only)) for f in families)
    out = Path(args.out).resolve()
    failures = 0
    if not args.no_train:
        warm = ensure_warm_start(out, TESTBED, args.run_timeout)
        deadline = time.time() + args.budget_minutes * 60 if args.budget_minutes else None
        todo = planned(families)

        def work(item) -> bool:
            i, (fam, seed) = item
            name = run_name(fam, seed)
            run_dir = out / "runs" / name
            cfg = run_config(fam, seed, warm, run_dir, sets)
            if is_done(run_dir, cfg):
                return True
            if deadline is not None and time.time() > deadline:
                print(f"[monitor-set] budget spent; {name} not started", flush=True)
                return True
            rc, wall, tail = train_once(cfg, run_dir, args.run_timeout)
            ok = (run_dir / "metrics.jsonl").is_file() and (run_dir / "train_summary.json").is_file()
            print(f"[monitor-set] {i}/{len(todo)} {name}: exit {rc}, {wall:.0f}s" +
                  ("" if ok else f", no outputs; log tail:\n{tail}"), flush=True)
            return ok

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # the planned order, args.jobs at a time
            failures = sum(not ok for ok in pool.map(work, enumerate(todo, 1)))
    if args.write:
        labels = write_set(out, Path(args.write), families, args.stability, args.heldout_grid, args.dev_grid)
        n = {k: sum(x["label"] == k for x in labels) for k in ("collapse", "healthy", "degraded")}
        print(f"[monitor-set] wrote {len(labels)} streams to {args.write} ({n['collapse']} collapse, "
              f"{n['healthy']} healthy, {n['degraded']} degraded)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
