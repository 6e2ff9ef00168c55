"""A real one-node Slurm for the tests in this directory (marker ``slurm``).

As root with apt-get (CI), the session installs Debian's slurmctld/slurmd/slurm-client/munge
once, starts the daemons and stops the ones it started by PID at the end. Elsewhere every
test here is skipped with the reason printed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from .cluster import LocalSlurm, SlurmUnavailable, start_local_slurm

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm() -> LocalSlurm:
    try:
        cluster = start_local_slurm()
    except SlurmUnavailable as e:
        reason = f"local Slurm unavailable: {e}"
        print(f"\n[tests/slurm] SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    yield cluster
    cluster.stop()


@pytest.fixture
def job_env(slurm: LocalSlurm, tmp_path: Path) -> dict:
    """The environment of a user who activated this checkout's venv and submits from the repo."""
    env = dict(slurm.env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DPCC_LOG_ROOT"] = str(tmp_path / "logs")
    env.pop("DPCC_MONITOR_TOKEN", None)
    return env
