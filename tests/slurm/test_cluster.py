"""The local-cluster helper's pure parts (no Slurm needed)."""
from __future__ import annotations

import fcntl
import os

import pytest

from .cluster import SlurmUnavailable, _session_lock, slurm_conf_text


def test_conf_has_the_settings_that_work_on_one_node(tmp_path):
    text = slurm_conf_text(tmp_path, "node0", 2)
    for line in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
                 "SlurmUser=root", "NodeName=node0 CPUs=2 State=UNKNOWN", "AuthInfo=cred_expire=5",
                 f"StateSaveLocation={tmp_path}/state"):
        assert line in text.splitlines()
    assert "OverSubscribe=YES" in text and "Nodes=node0" in text


def test_a_second_session_waits_for_the_lock_then_gives_up(tmp_path):
    path = tmp_path / "session.lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(SlurmUnavailable, match="another test session held the local Slurm"):
            _session_lock(path, timeout=1.0)
    finally:
        os.close(holder)
    fd = _session_lock(path, timeout=1.0)  # free again
    os.close(fd)
