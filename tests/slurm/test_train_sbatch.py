"""slurm/train_dpcc.sbatch on a real local Slurm with examples/tiny_cpu.yaml (2 tasks, TP=2, gloo, CPU).

Cost: the trainer's start-up (imports, model build) dominates. ~8 s for the two rejected
submissions; measured on 2 cores shared with other work (load 8-20): 90 s for the training
job and 150-175 s for the preempted-and-requeued one (two start-ups and a ~7 s requeue
delay). The same config under plain torchrun took 34 s at a lower load.
"""
from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = REPO / "slurm" / "train_dpcc.sbatch"
CONFIG = "examples/tiny_cpu.yaml"
JOB_TIMEOUT = 300


def submit(slurm, env, tmp_path: Path, *overrides: str, name: str = "dpcc-test") -> tuple[int, Path]:
    """Submit the tiny CPU job as a user would; returns (job id, its per-job log directory)."""
    args = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", f"--job-name={name}", f"--chdir={REPO}",
            f"--output={tmp_path}/batch-%j.out", str(SBATCH), CONFIG,
            f"train.output_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}", *overrides]
    job = slurm.sbatch(args, env=env)
    return job, tmp_path / "logs" / f"{name}-{job}"


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<{path} missing>"


def diagnostics(tmp_path: Path, job: int, logdir: Path) -> str:
    """What to look at when a job did not do what was expected."""
    parts = [f"--- batch output\n{read(tmp_path / f'batch-{job}.out')[-3000:]}"]
    for rank0 in sorted(logdir.glob("attempt-*/rank-0.log")):
        text = "\n".join(x for x in read(rank0).splitlines() if "warn" not in x.lower())
        parts.append(f"--- {rank0.relative_to(logdir)}\n{text[-3000:]}")
    return "\n".join(parts)


def train_records(db: Path) -> list[tuple[int, int, int]]:
    """(first iteration, last iteration, count) of the sidecar's train records, per client attempt."""
    with sqlite3.connect(db) as con:
        return con.execute("SELECT MIN(iteration), MAX(iteration), COUNT(*) FROM records WHERE kind = 'train' "
                           "GROUP BY attempt ORDER BY MIN(received)").fetchall()


def test_invalid_layout_stops_before_any_rank(slurm, job_env, tmp_path):
    job, logdir = submit(slurm, job_env, tmp_path, "parallel.tensor_model_parallel_size=3")
    info = slurm.wait(job, timeout=120)
    out = read(tmp_path / f"batch-{job}.out")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, out)
    assert "the layout is invalid for 2 task(s)" in out
    assert "model.num_attention_heads=2 is not divisible by tensor_model_parallel_size=3" in out
    assert "2 GPUs are not divisible by TP x PP x CP = 3 x 1 x 1 = 3" in out
    assert not list(logdir.glob("attempt-0/rank-*.log")) and not (logdir / "attempt-0" / "sidecar.log").exists()


def test_rejects_an_argument_that_is_not_key_value(slurm, job_env, tmp_path):
    job, _ = submit(slurm, job_env, tmp_path, "optim.lr")
    info = slurm.wait(job, timeout=60)
    assert info["ExitCode"] == "2:0", info
    assert "argument 'optim.lr' is not key=value" in read(tmp_path / f"batch-{job}.out")


def test_tiny_cpu_job_trains_reports_to_the_sidecar_and_checkpoints(slurm, job_env, tmp_path):
    job, logdir = submit(slurm, job_env, tmp_path)
    info = slurm.wait(job, timeout=JOB_TIMEOUT)
    why = diagnostics(tmp_path, job, logdir)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, why)
    assert "[dpcc] completed" in read(logdir / "attempt-0" / "rank-0.log"), why
    # CPUs per rank: the node's 2 CPUs over 2 tasks; task/none here cannot bind, and the log says so
    assert ("CPUs: 1 per rank of the 2 the job holds on a node, unbound: this Slurm's TaskPlugin=task/none "
            "cannot bind") in read(logdir / "batch.log"), read(logdir / "batch.log")

    # Checkpoints: every save_interval=2 iterations and at the end, the newest two kept; the monitor's
    # control is on (a sidecar), so retention also keeps the rollback target: the newest checkpoint at
    # or before the last healthy iteration minus the evidence window
    ck = tmp_path / "ck"
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    assert (ck / "iter_0000006" / "metadata.json").is_file() and (ck / "iter_0000006" / "common.pt").is_file()
    kept = sorted(p.name for p in ck.glob("iter_*"))
    # (and every later one); the start is saved because the run can roll back
    assert kept in (["iter_0000002", "iter_0000004", "iter_0000006"],
                    ["iter_0000000", "iter_0000002", "iter_0000004", "iter_0000006"]), kept

    # The sidecar got one train record per iteration (0..5), and was stopped with the job.
    assert train_records(tmp_path / "out" / "monitor" / "monitor.sqlite") == [(0, 5, 6)], why
    sidecar = json.loads((logdir / "attempt-0" / "sidecar.json").read_text())
    assert sidecar["address"].startswith("127.0.0.1:")
    assert not Path(f"/proc/{sidecar['pid']}").exists(), "the sidecar outlived its job"
    assert "dpcc-monitor stopped" in read(logdir / "attempt-0" / "sidecar.log")


def test_preempted_job_checkpoints_requeues_and_resumes(slurm, job_env, tmp_path):
    iterations = 12
    job, logdir = submit(slurm, job_env, tmp_path, f"train.iterations={iterations}", name="dpcc-preempt")
    latest = tmp_path / "ck" / "latest"
    deadline = time.monotonic() + JOB_TIMEOUT
    # the first periodic checkpoint (not the start, which a run that can roll back saves first): under way
    while not latest.exists() or latest.read_text().strip() == "iter_0000000":
        state = slurm.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, diagnostics(tmp_path, job, logdir))
        assert time.monotonic() < deadline, "no checkpoint appeared\n" + diagnostics(tmp_path, job, logdir)
        time.sleep(0.2)
    # What --signal=B:USR1@N does before the time limit: SIGUSR1 to the batch shell only.
    slurm.signal_batch(job, "USR1")
    info = slurm.wait(job, timeout=JOB_TIMEOUT)
    why = diagnostics(tmp_path, job, logdir)
    first, second = logdir / "attempt-0" / "rank-0.log", logdir / "attempt-1" / "rank-0.log"
    if "BrokenPipeError" in read(first):
        pytest.fail("the trainer's checkpoint save after SIGUSR1 died with BrokenPipeError: slurmstepd delivers "
                    "the signal to every process of the task, including the multiprocessing Manager that "
                    "megatron.core.dist_checkpointing caches on the first save; it must be created with "
                    "SIGUSR1/SIGTERM blocked (dpcc_megatron/megatron/checkpoint.py)\n" + why)
    assert "[dpcc] stopped by SIGUSR1" in read(first), why
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, why)
    assert info["Restarts"] == "1", (info, why)

    m = re.search(r"\[dpcc\] resumed from (\S+) at iteration (\d+)", read(second))
    assert m, "the requeued attempt did not resume from a checkpoint\n" + why
    resumed_at = int(m.group(2))
    assert 2 <= resumed_at < iterations and Path(m.group(1)).name == f"iter_{resumed_at:07d}"
    assert "checkpoint.resume=required" in read(logdir / "batch.log")  # a restart never starts from scratch
    assert "[dpcc] completed" in read(second), why
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"iter_{iterations:07d}"

    # The sidecar database saw both attempts: the second continues where the checkpoint left off.
    runs = train_records(tmp_path / "out" / "monitor" / "monitor.sqlite")
    assert len(runs) == 2, (runs, why)
    assert runs[0][0] == 0 and runs[0][1] == resumed_at - 1
    assert runs[1][:2] == (resumed_at, iterations - 1)
    assert not os.path.exists(tmp_path / "ck" / f".tmp_iter_{resumed_at:07d}")


def test_signal_lead_time_is_a_parameter(slurm, job_env, tmp_path):
    """DPCC_SIGNAL_LEAD arms the script's own SIGUSR1 timer that long before the job's end; the header's
    --signal is overridden on the sbatch command line (here to 10 s before the end: never before ~110 s)."""
    env = dict(job_env, DPCC_SIGNAL_LEAD="165", DPCC_MONITOR="0")  # 3 min limit - 165 s: SIGUSR1 after ~15 s
    args = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--job-name=dpcc-lead", f"--chdir={REPO}",
            "--time=3", "--signal=B:USR1@10", f"--output={tmp_path}/batch-%j.out", str(SBATCH), CONFIG,
            f"train.output_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}", "train.iterations=100000"]
    job = slurm.sbatch(args, env=env)
    logdir = tmp_path / "logs" / f"dpcc-lead-{job}"
    batch_log = logdir / "batch.log"
    try:
        deadline = time.monotonic() + 120
        while "SIGUSR1: time limit" not in read(batch_log):
            assert slurm.job(job)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), read(batch_log)
            assert time.monotonic() < deadline, "no SIGUSR1 within 120 s\n" + read(batch_log)
            time.sleep(0.5)
        text = read(batch_log)
        armed = re.search(r"\[dpcc (\d+):(\d+):(\d+)\] preemption timer: SIGUSR1 in (\d+) s "
                          r"\(DPCC_SIGNAL_LEAD=165 s before the end time", text)
        fired = re.search(r"\[dpcc (\d+):(\d+):(\d+)\] SIGUSR1: time limit", text)
        assert armed and fired, text
        delay = int(armed.group(4))
        assert 0 <= delay <= 15, text  # end = start + 180 s: 15 s less the start-up so far
        seconds = [int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)) for m in (armed, fired)]
        took = (seconds[1] - seconds[0]) % 86400
        assert abs(took - delay) <= 3, (took, delay, text)  # our timer fired it, not Slurm's (>= ~110 s in)
    finally:
        subprocess.run(["scancel", str(job)], env=slurm.env, timeout=15, capture_output=True)
