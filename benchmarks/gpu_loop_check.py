"""The real DPCC loop on one GPU: rollout, old log-probs, update, save, resume.

    python benchmarks/gpu_loop_check.py [--out DIR] [--timeout S] [--allow-cpu | --tiny]

Two launches of ``dpcc-megatron train`` (``python -m dpcc_megatron.cli train``, one rank) with
``examples/tiny_cpu.yaml`` at TP1, the local layer spec, bf16 and the backend picked per machine
(NCCL on a GPU):

1. iteration 0 (rollout with the policy, rewards, old log-probs through the forward-only schedule,
   the DPCC update through the 1F1B schedule, metrics), checkpoint, stop (``train.exit_interval=1``);
2. resume from that checkpoint, iteration 1, checkpoint; the run completes (``train.iterations=2``).

Every per-machine default is in force: on a GPU that means asynchronous checkpoints, the DP
overlaps (a no-op at DP=1), released memory between phases, sampling on the GPU's generator.
It checks the exit statuses, the launch line (launcher, layout, device), the resume, the
checkpoints and the metric records (finite entropy, KL and sampler/trainer mismatch), and ends
with one JSON line. Without CUDA it refuses (exit status 2, saying so) unless ``--allow-cpu`` or
its alias ``--tiny``, the name every benchmark script's CI check passes (a dry run of the script on
the CPU execution layer, not a GPU result). ``benchmarks/gpu_check.sh`` runs it first.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_command(out: Path, extra: list[str]) -> list[str]:
    sets = {
        "parallel.tensor_model_parallel_size": 1, "parallel.backend": "auto",
        "precision.params_dtype": "bf16", "precision.transformer_engine": "false",
        "train.iterations": 2, "train.exit_interval": 1, "train.output_dir": out / "run",
        "checkpoint.dir": out / "ck", "checkpoint.save_interval": 1, "checkpoint.resume": "auto",
        "monitor.enabled": "false",
    }
    cmd = [sys.executable, "-m", "dpcc_megatron.cli", "train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    for kv in extra:
        cmd += ["--set", kv]
    return cmd


def launch(cmd: list[str], timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in res.stdout.splitlines() if x.startswith("[dpcc]")]
    return {"rc": res.returncode, "seconds": round(time.time() - t0, 1), "dpcc_lines": lines,
            "stderr_tail": res.stderr[-2500:] if res.returncode else ""}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="working directory (default: a fresh temporary one)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    ap.add_argument("--allow-cpu", "--tiny", action="store_true", help="dry run on the CPU (not a GPU result)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra config override")
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_loop_check: no CUDA device (use --allow-cpu or --tiny for a dry run of the script)", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="dpcc-gpu-loop-"))
    cmd = train_command(out, args.extra)
    result = {"check": "gpu_loop", "cuda": cuda, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
              "torch": torch.__version__, "python": sys.version.split()[0], "out": str(out)}
    try:
        import megatron.core

        result["megatron_core"] = getattr(megatron.core, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001 - reported, the launches will fail and say why
        result["megatron_core"] = f"not importable: {e}"
    problems = []
    first = launch(cmd, args.timeout)
    ck = out / "ck"
    latest_after_first = (ck / "latest").read_text().strip() if (ck / "latest").exists() else None
    second = launch(cmd, args.timeout) if first["rc"] == 0 else None
    result.update(first=first, second=second)

    device = "cuda:0" if cuda else "cpu"
    if first["rc"] != 0:
        problems.append(f"first launch exited {first['rc']}")
    if not any(f"1 ranks from single: TP1 PP1 DP1, {device}" in x for x in first["dpcc_lines"]):
        problems.append(f"first launch did not report TP1 PP1 DP1 on {device}")
    if latest_after_first != "iter_0000001":
        problems.append(f"after the first launch `latest` is {latest_after_first!r}, not iter_0000001")
    if second is not None:
        if second["rc"] != 0:
            problems.append(f"second launch exited {second['rc']}")
        if not any("resumed from" in x and "at iteration 1" in x for x in second["dpcc_lines"]):
            problems.append("second launch did not resume at iteration 1")
        summary_path = out / "run" / "train_summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        result["summary"] = {k: summary.get(k) for k in ("stop_kind", "iterations", "steps_taken", "steps_skipped",
                                                          "reward_before", "reward_after")}
        if summary.get("stop_kind") != "completed" or summary.get("iterations") != 2:
            problems.append(f"the resumed run did not complete 2 iterations: {result['summary']}")
        latest = (ck / "latest").read_text().strip() if (ck / "latest").exists() else None
        if latest != "iter_0000002":
            problems.append(f"`latest` is {latest!r} after the second launch, not iter_0000002")
        records_path = out / "run" / "metrics.jsonl"
        records = [json.loads(x) for x in records_path.read_text().splitlines()] if records_path.exists() else []
        last = records[-1] if records else {}
        result["record"] = {k: last.get(k) for k in ("iteration", "reward_mean", "entropy", "kl_old_new",
                                                     "mismatch_kl", "grad_norm", "tokens_per_s", "seconds")}
        for key in ("entropy", "kl_old_new", "mismatch_kl", "grad_norm"):
            if not _finite(last.get(key)):
                problems.append(f"metric {key} of the last record is {last.get(key)!r}")
    result["problems"] = problems
    result["ok"] = not problems
    for name in ("first", "second"):
        part = result.get(name)
        if part:
            print(f"--- launch {name}: status {part['rc']}, {part['seconds']} s")
            for line in part["dpcc_lines"]:
                print("   ", line)
            if part["stderr_tail"]:
                print(part["stderr_tail"])
    print(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
