"""`dpcc-megatron demo [--out DIR]`: the README's first command.

GRPO and the default DPCC, side by side, from one shared warm-start, at an LR where GRPO collapses on
this task in most seeds (``benchmarks/stability/demo-lr.md``, written before the demo ran: 2e-3, chosen
on held-out seeds 901-916 where GRPO collapsed in 12 of 16 runs and DPCC in none; the demo's seed is
1234). The job is the stability benchmark's testbed of those runs (:data:`COMPARISON` over
:data:`DEMO_CONFIG`): the tiny GPT and the character tokenizer, 60 supervised warm-start steps on
1-digit addition, then 20 RL iterations per method, each a real ``dpcc-megatron train`` launch with
the monitor sidecar watching (its control off, so both runs train as in that benchmark).

Writes DIR/summary.json (``methods: {grpo: {...}, dpcc: {...}}``, each with ``reward_before``,
``reward_after`` and ``collapsed``) and DIR/report.png (reward, entropy, KL, τ and LR factor of both,
collapses marked); each run's own outputs are in DIR/<method>/, the warm-start in DIR/warm_start/.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: The demo's model and task. The stability benchmark builds its base job on it
#: (``benchmarks/stability/grid.py``): change it only with that benchmark.
DEMO_CONFIG = {
    "model": {"num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 4,
              "num_query_groups": 2, "vocab_size": 128, "make_vocab_size_divisible_by": 64, "max_seq_len": 64},
    "parallel": {"tensor_model_parallel_size": 2, "use_distributed_optimizer": False},
    # One-digit addition: a short warm-start leaves the tiny model about half right, so RL has room.
    "data": {"synthetic_task": "addition", "synthetic_digits": 1, "max_prompt_len": 16},
    "rollout": {"group_size": 8, "prompts_per_iteration": 16, "max_new_tokens": 5, "temperature": 1.0,
                "batch_size": 128},
    "loss": {"name": "dpcc"},
    "optim": {"lr": 2e-4, "clip_grad": 1.0},
    "train": {"iterations": 150, "inner_epochs": 1, "mini_batch_size": 64, "micro_batch_size": 16,
              "warmup_sft_steps": 60, "warmup_sft_lr": 3e-3, "seed": 1234},
    # Held-out synthetic prompts: greedy reward and pass@k (4 samples) before RL, every 25 iterations, at the end.
    "eval": {"interval": 25, "samples": 4},
}

#: The comparison's job over :data:`DEMO_CONFIG` (dotted keys): the stability benchmark's testbed of
#: ``benchmarks/stability/latched-recovery.md#addition`` (grid ``small``) at the pre-registered LR and seed.
COMPARISON = {
    "parallel.tensor_model_parallel_size": 1,
    "rollout.prompts_per_iteration": 8, "rollout.batch_size": 64, "rollout.max_new_tokens": 4,
    "train.iterations": 20, "train.mini_batch_size": 32, "train.warmup_sft_steps": 0,
    "optim.lr": 2e-3, "train.seed": 1234, "checkpoint.resume": "never",
    "monitor.control_enabled": False,  # the monitor watches and alerts; its advice does not act
}
#: The shared warm-start: supervised steps, their LR and seed (the benchmark's).
WARM_START = {"steps": 60, "lr": 3e-3, "seed": 1}
#: The methods, as the stability benchmark runs them: GRPO on the rule reward without the drift-aware LR,
#: and the default DPCC.
METHODS = {
    "grpo": {"loss.name": "grpo", "loss.dpcc.drift_lr": False, "reward.base_weight": 1.0,
             "reward.advanced_weight": 0.0},
    "dpcc": {"loss.name": "dpcc"},
}


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="runs/demo", help="output directory")
    parser.add_argument("--iterations", type=int, default=None, help="RL iterations of each method (default 20)")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start steps (default 60)")
    parser.add_argument("--no-monitor", action="store_true", help="run without the sidecar")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a demo config key")


def _config(overrides: dict) -> dict:
    from ..config import apply_override

    cfg = json.loads(json.dumps(DEMO_CONFIG))
    for key, value in overrides.items():
        apply_override(cfg, f"{key}={json.dumps(value)}")
    return cfg


def _train(cfg: dict, run_dir: Path, env: dict) -> int:
    """One ``dpcc-megatron train`` launch of ``cfg`` (its config checked first, naming a bad key)."""
    import yaml

    from ..config import load_config

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    load_config(cfg_path)
    nproc = cfg["parallel"]["tensor_model_parallel_size"] * cfg["parallel"].get("pipeline_model_parallel_size", 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dpcc_megatron.cli", "train", "--config", str(cfg_path)]
    print(f"[demo] {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env)


def warm_start_overrides(steps: int, warm: Path) -> dict:
    """The shared warm-start's job over :data:`COMPARISON`: supervised steps only, no RL iteration."""
    return {"train.iterations": 0, "train.warmup_sft_steps": steps, "train.warmup_sft_lr": WARM_START["lr"],
            "train.seed": WARM_START["seed"], "optim.lr": DEMO_CONFIG["optim"]["lr"], "monitor.enabled": False,
            "train.output_dir": str(warm), "checkpoint.dir": str(warm / "checkpoints")}


def main(args) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = dict(COMPARISON)
    if args.iterations is not None:
        base["train.iterations"] = args.iterations
    sets = {}
    for o in args.overrides:
        key, sep, value = o.partition("=")
        if not sep or not key:
            print(f"[demo] --set takes KEY=VALUE, got {o!r}", file=sys.stderr)
            return 2
        sets[key] = value
    steps = WARM_START["steps"] if args.sft_steps is None else args.sft_steps
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()

    from ..config import apply_override

    def config(overrides: dict) -> dict:
        cfg = _config({**base, **overrides})
        for key, value in sets.items():  # --set applies last, as the trainer's --set does
            apply_override(cfg, f"{key}={value}")
        return cfg

    warm = out / "warm_start"
    ckpt = warm / "checkpoints" / "iter_0000000"
    print(f"[demo] shared warm-start: {steps} supervised steps -> {ckpt}", flush=True)
    rc = _train(config(warm_start_overrides(steps, warm)), warm, env)
    if rc != 0 or not ckpt.is_dir():
        print(f"[demo] the warm-start failed with exit code {rc}", file=sys.stderr)
        return rc or 1
    for method, overrides in METHODS.items():
        run_dir = out / method
        cfg = config({**overrides, "checkpoint.load": str(ckpt), "train.output_dir": str(run_dir),
                      "checkpoint.dir": str(run_dir / "checkpoints")})
        rc = _run_with_sidecar(cfg, run_dir, env, monitor=not args.no_monitor)
        if rc != 0:
            print(f"[demo] {method} failed with exit code {rc}", file=sys.stderr)
            return rc
    return write_summary(out, time.time() - t0)


def _run_with_sidecar(cfg: dict, run_dir: Path, env: dict, monitor: bool) -> int:
    """Train ``cfg`` with a monitor sidecar of its own watching (``--set monitor.*`` reaches both)."""
    mon = cfg.setdefault("monitor", {})
    if not monitor:
        mon["enabled"] = False
        return _train(cfg, run_dir, env)
    from ..config import JobConfig, from_dict
    from ..monitor.launcher import start_sidecar

    mon["enabled"] = True
    run_dir.mkdir(parents=True, exist_ok=True)
    sidecar = start_sidecar(str(run_dir / "monitor.db"), cfg=from_dict(JobConfig, cfg).monitor,
                            output_dir=str(run_dir / "monitor"), log_path=str(run_dir / "monitor.log"))
    mon["address"] = sidecar.address
    print(f"[demo] monitor sidecar at http://{sidecar.address} (metrics: /metrics)", flush=True)
    try:
        return _train(cfg, run_dir, {**env, "DPCC_MONITOR_TOKEN": sidecar.token})
    finally:
        sidecar.stop()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def method_summary(run_dir: Path):
    """(summary dict, :class:`MethodRun`) of one method's finished run."""
    from ..monitor.compare import MethodRun
    from ..monitor.labels import label_stream
    from ..monitor.report import severity_counts

    import yaml

    from ..config.algo import LossConfig

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    ts = json.loads((run_dir / "train_summary.json").read_text())
    records = [r for r in _jsonl(run_dir / "metrics.jsonl") if r.get("kind", "train") == "train"]
    before, after = ts.get("reward_before"), ts.get("reward_after")
    verdict = label_stream(records, ts.get("stop_reason", ""), greedy=(before, after))
    alerts = ts.get("alerts", [])
    crit = next((a for a in alerts if a.get("confirmed") and a.get("severity") == "critical"), None)
    reward = [r.get("reward_base_mean", r.get("reward_mean")) for r in records]
    summary = {
        "reward_before": before, "reward_after": after,
        "collapsed": verdict["label"] == "collapse",
        "collapse_iteration": verdict["onset"],
        "label": verdict["label"],  # collapse, degraded (ended below its start) or healthy
        "monitor_first_critical": {"iteration": crit["iteration"], "rule": crit["rule"]} if crit else None,
        "alerts_by_severity": severity_counts(alerts),
        "eval": ts.get("eval"),
        "iterations": ts.get("iterations"),
        "reward_first": reward[0] if reward else None, "reward_last": reward[-1] if reward else None,
        "entropy_first": records[0].get("entropy") if records else None,
        "entropy_last": records[-1].get("entropy") if records else None,
        "kl_last": ts.get("kl_last"), "tau_last": ts.get("tau_last"), "lr_factor_last": ts.get("lr_factor_last"),
        "steps_taken": ts.get("steps_taken"), "steps_skipped": ts.get("steps_skipped"),
        "lr_scale_from_monitor": ts.get("lr_scale_from_monitor"), "advice_fallbacks": ts.get("advice_fallbacks"),
        "alerts": alerts,
    }
    loss = cfg["loss"]
    # only DPCC adapts its ratio bound; the others clip at a fixed 1 + eps (the record's tau is the idle controller's)
    fixed = {} if loss.get("name") == "dpcc" else {"tau": 1.0 + float(loss.get("clip_eps", LossConfig.clip_eps))}
    run = MethodRun(run_dir.name, records, before, after, verdict["onset"], summary["collapsed"],
                    (crit["iteration"], crit["rule"]) if crit else None, fixed)
    return summary, run


def write_summary(out: Path, seconds: float) -> int:
    import yaml

    from ..monitor.compare import render_comparison

    methods, runs = {}, []
    for method in METHODS:
        methods[method], run = method_summary(out / method)
        runs.append(run)
    cfg = yaml.safe_load((out / "dpcc" / "config.yaml").read_text())
    summary = {"lr": cfg["optim"]["lr"], "seed": cfg["train"]["seed"], "iterations": cfg["train"]["iterations"],
               "warm_start": str(out / "warm_start" / "checkpoints" / "iter_0000000"),
               "methods": methods, "wall_seconds": round(seconds, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    render_comparison(runs, out / "report.png",
                      f"dpcc-megatron demo: GRPO and DPCC from one warm-start at LR {summary['lr']:g}, "
                      f"seed {summary['seed']}, {summary['iterations']} iterations")
    for name, m in methods.items():
        print(f"[demo] {name}: held-out greedy reward {m['reward_before']} -> {m['reward_after']}, "
              + (f"collapsed at iteration {m['collapse_iteration']}" if m["collapsed"] else f"{m['label']}"))
    print(f"[demo] wrote {out / 'summary.json'} and {out / 'report.png'} ({seconds:.0f} s)")
    print(json.dumps({name: {k: m[k] for k in ("reward_before", "reward_after", "collapsed")}
                      for name, m in methods.items()}))
    return 0
