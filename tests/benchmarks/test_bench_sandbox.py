"""benchmarks/bench_sandbox.py --tiny: every available mode scores the same samples alike, and the
figures come out as one JSON line."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sandbox_tiny():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sandbox.py"), "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "sandbox" and result["tiny"]
    assert result["verdicts_agree"]
    assert result["passed_total"] == 10  # the four honest solutions pass all their asserts, nothing else does
    assert {"none", "namespaces"} <= set(result["runs_per_s"])  # this host has user namespaces
    assert all(r > 0 for r in result["runs_per_s"].values())
    assert result["ratio_to_none"]["none"] == 1.0
