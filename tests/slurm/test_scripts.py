"""The other scripts in slurm/: the standalone sidecar (plain bash) and the HF conversion job (Slurm)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import REPO


def test_standalone_sidecar_script_serves_until_terminated(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               DPCC_MONITOR_TOKEN="a-test-token-123")
    db = tmp_path / "monitor.sqlite"
    log = open(tmp_path / "sidecar.out", "w+")
    proc = subprocess.Popen(["bash", str(REPO / "slurm" / "monitor_sidecar.sbatch"), "--db", str(db)],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in (tmp_path / "sidecar.out").read_text():
            assert proc.poll() is None, (tmp_path / "sidecar.out").read_text()
            assert time.monotonic() < deadline, "the sidecar did not start within 60 s"
            time.sleep(0.2)
        ready = json.loads(next(tmp_path.glob("dpcc-monitor-*.json")).read_text())
        assert ready["address"].startswith("127.0.0.1:") and "token" not in ready  # the token came from the env
        with urllib.request.urlopen(f"http://{ready['address']}/healthz", timeout=5) as r:
            assert r.status == 200
        # The script prints the trainer settings right after the ready file appears: wait for them.
        want = f"--set monitor.address={ready['address']}"
        while not (want in (out := (tmp_path / "sidecar.out").read_text()) and "(as exported here)" in out):
            assert time.monotonic() < deadline, out
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert db.is_file()
        assert not Path(f"/proc/{ready['pid']}").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.mark.slurm
@pytest.mark.slow
def test_convert_hf_sbatch_converts_a_tiny_model(slurm, job_env, tmp_path):
    from tests.convert.hf_models import build_hf

    hf = tmp_path / "hf"
    build_hf("qwen2", hf)
    out = tmp_path / "mcore"
    job = slurm.sbatch([f"--chdir={tmp_path}", f"--output={tmp_path}/convert-%j.out", "--cpus-per-task=1",
                        str(REPO / "slurm" / "convert_hf.sbatch"), "--hf", str(hf), "--out", str(out), "--tp", "2"],
                       env=job_env)
    info = slurm.wait(job, timeout=300)
    log = (tmp_path / f"convert-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    assert "done, status 0" in log
    assert (out / "metadata.json").is_file(), sorted(p.name for p in out.iterdir())


@pytest.mark.slurm
def test_convert_hf_sbatch_rejects_missing_arguments(slurm, job_env, tmp_path):
    job = slurm.sbatch([f"--chdir={tmp_path}", f"--output={tmp_path}/convert-%j.out", "--cpus-per-task=1",
                        str(REPO / "slurm" / "convert_hf.sbatch"), "--hf", str(tmp_path)], env=job_env)
    info = slurm.wait(job, timeout=60)
    assert info["ExitCode"] == "2:0", info
    assert "usage: sbatch slurm/convert_hf.sbatch --hf DIR --out DIR" in (tmp_path / f"convert-{job}.out").read_text()
