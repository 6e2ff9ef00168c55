"""`dpcc-megatron demo` (the README's first command), with a reduced step count."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_writes_summary_and_report(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "demo", "--out", str(out),
                           "--iterations", "2", "--sft-steps", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("reward_before", "reward_after", "iterations", "kl_last", "tau_last", "lr_factor_last", "alerts"):
        assert key in summary, key
    assert summary["iterations"] == 2
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "monitor.db").stat().st_size > 0  # the sidecar stored the records
