"""A real 2-rank CPU training job under Open MPI's mpirun, through our launch path: ranks from
mpi4py (COMM_WORLD, the node's shared-memory communicator, rank 0's host broadcast), then gloo.

The session fixture installs Debian's Open MPI (`openmpi-bin`, `libopenmpi-dev`) with apt-get when
`mpirun` is missing and the suite runs as root; mpi4py comes from the `test` extra (its PyPI wheel
loads the system libmpi). Otherwise the test is skipped with the reason printed. ~40 s on 2 cores.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dpcc_megatron.testing.multirank import free_port

pytestmark = [pytest.mark.mpi, pytest.mark.multirank, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("openmpi-bin", "libopenmpi-dev")


def _install_openmpi(timeout: float = 600) -> str | None:
    """None when mpirun is (now) available, else why not."""
    if shutil.which("mpirun"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "mpirun is not installed, and installing Open MPI needs root and apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` timed out after {timeout:.0f} s"
        if res.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {res.stderr.strip()[-400:]}"
    return None if shutil.which("mpirun") else "apt-get installed Open MPI but mpirun is not on PATH"


@pytest.fixture(scope="session")
def mpirun() -> str:
    reason = _install_openmpi()
    if reason is None:
        probe = subprocess.run([sys.executable, "-c", "import mpi4py.MPI"], capture_output=True, text=True,
                               timeout=60)
        if probe.returncode != 0:
            reason = ("mpi4py does not import in this environment (install the test extra: "
                      f"pip install -e '.[test]'): {probe.stderr.strip().splitlines()[-1:]}")
    if reason is not None:
        print(f"\n[tests/launch/test_mpirun] SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return shutil.which("mpirun")


def test_mpirun_runs_a_two_rank_training_job(mpirun, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    exported = [a for k in ("PATH", "PYTHONPATH", "MASTER_PORT", "OMP_NUM_THREADS", "HOME") if k in env
                for a in ("-x", k)]
    out, ck = tmp_path / "out", tmp_path / "ck"
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", *exported,
           sys.executable, "-m", "dpcc_megatron.cli", "train", "--config", "examples/tiny_cpu.yaml",
           "--set", "train.iterations=2", "--set", f"train.output_dir={out}", "--set", f"checkpoint.dir={ck}",
           "--set", "monitor.enabled=false", "--set", "rollout.max_new_tokens=3"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = f"--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    # Rank discovery went through MPI (not a fallback), and both ranks formed one TP=2 group.
    assert "[dpcc] 2 ranks from mpi: TP2 PP1 DP1" in res.stdout, log
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["stop_kind"] == "completed" and summary["iterations"] == 2, summary
    assert summary["steps_taken"] == 2 and summary["steps_skipped"] == 0, summary
    assert (ck / "latest").read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in (ck / "iter_0000002" / "rng").iterdir()) == [
        "local0.pt", "local1.pt", "rank0.pt", "rank1.pt"]
