"""`dpcc-megatron demo [--out DIR]`: the README's first command.

A tiny GPT and the character tokenizer, a supervised warm-start on multi-digit addition,
then DPCC RL at TP=2 over two local gloo ranks with the monitor sidecar running.
Writes DIR/summary.json and DIR/report.png.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="runs/demo", help="output directory")
    parser.add_argument("--iterations", type=int, default=None, help="RL iterations (default 150)")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start steps (default 60)")
    parser.add_argument("--no-monitor", action="store_true", help="run without the sidecar")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a demo config key")


def main(args) -> int:
    import yaml

    from ..config import apply_override, load_config

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(DEMO_CONFIG))
    if args.iterations is not None:
        cfg["train"]["iterations"] = args.iterations
    if args.sft_steps is not None:
        cfg["train"]["warmup_sft_steps"] = args.sft_steps
    cfg["train"]["output_dir"] = str(out)
    cfg["checkpoint"] = {"dir": str(out / "checkpoints"), "resume": "never"}
    for o in args.overrides:
        apply_override(cfg, o)
    sidecar = None
    env = dict(os.environ)
    monitor = cfg.setdefault("monitor", {})  # --set monitor.* reaches the trainer and the sidecar alike
    if not args.no_monitor:
        from ..config import JobConfig, from_dict
        from ..monitor.launcher import start_sidecar

        monitor["enabled"] = True
        sidecar = start_sidecar(str(out / "monitor.db"), cfg=from_dict(JobConfig, cfg).monitor,
                                output_dir=str(out / "monitor"), log_path=str(out / "monitor.log"))
        monitor["address"] = sidecar.address
        env["DPCC_MONITOR_TOKEN"] = sidecar.token
        print(f"[demo] monitor sidecar at http://{sidecar.address} (metrics: /metrics)", flush=True)
    else:
        monitor["enabled"] = False
    cfg_path = out / "demo_config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    load_config(cfg_path)  # fail here, with the key named, rather than in two ranks

    nproc = cfg["parallel"]["tensor_model_parallel_size"] * cfg["parallel"].get("pipeline_model_parallel_size", 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dpcc_megatron.cli", "train", "--config", str(cfg_path)]
    print(f"[demo] {' '.join(cmd)}", flush=True)
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    try:
        rc = subprocess.call(cmd, env=env)
    finally:
        if sidecar is not None:
            sidecar.stop()
    if rc != 0:
        print(f"[demo] training failed with exit code {rc}", file=sys.stderr)
        return rc
    return write_summary(out, time.time() - t0)


def write_summary(out: Path, seconds: float) -> int:
    from ..monitor.report import alert_headline, render_report, severity_counts

    train_summary = json.loads((out / "train_summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    eval_path = out / "eval.jsonl"
    evals = [json.loads(line) for line in eval_path.read_text().splitlines() if line.strip()] \
        if eval_path.is_file() else []
    summary = {
        "reward_before": train_summary.get("reward_before"),
        "reward_after": train_summary.get("reward_after"),
        "eval": train_summary.get("eval"),
        "iterations": train_summary.get("iterations"),
        "kl_last": train_summary.get("kl_last"),
        "tau_last": train_summary.get("tau_last"),
        "lr_factor_last": train_summary.get("lr_factor_last"),
        "alerts": train_summary.get("alerts", []),
        "alerts_by_severity": severity_counts(train_summary.get("alerts", [])),
        "steps_taken": train_summary.get("steps_taken"),
        "steps_skipped": train_summary.get("steps_skipped"),
        "lr_scale_from_monitor": train_summary.get("lr_scale_from_monitor"),
        "advice_fallbacks": train_summary.get("advice_fallbacks"),
        "reward_mean_first": records[0]["reward_mean"] if records else None,
        "reward_mean_last": records[-1]["reward_mean"] if records else None,
        "wall_seconds": round(seconds, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    render_report(records + evals, summary["alerts"], out / "report.png", title="dpcc-megatron demo")
    print(f"[demo] reward (greedy, held-out): {summary['reward_before']} -> {summary['reward_after']}")
    print(f"[demo] monitor alerts: {alert_headline(summary['alerts'])}")
    print(f"[demo] wrote {out / 'summary.json'} and {out / 'report.png'}")
    print(json.dumps({k: summary[k] for k in ("reward_before", "reward_after", "iterations", "kl_last",
                                              "tau_last", "lr_factor_last")}))
    return 0
