"""Smoke variant of the stability benchmark (benchmarks/stability): the real trainer on a tiny
grid, the cache that makes it resumable, the report, and the detector flagging a broken LR.

Budget: one 40-step warm-start and three 5-iteration runs, one process each (~2-3 min on 2 cores).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.stability.grid import AGGRESSIVE_LR, BROKEN_LR, run_key

ROOT = Path(__file__).resolve().parents[2]


def _module(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_smoke_grid_makes_the_table_and_flags_the_broken_lr(tmp_path):
    out = tmp_path / "stability"
    _module("benchmarks.stability.run", "--grid", "smoke", "--out", out)
    _module("benchmarks.stability.run", "--grid", "smoke", "--out", out, "--methods", "grpo", "--lrs", BROKEN_LR)
    # Resumable: every run is cached, so a rerun trains nothing.
    assert "0 to run" in _module("benchmarks.stability.run", "--grid", "smoke", "--out", out)

    md = tmp_path / "report" / "RESULTS.md"
    _module("benchmarks.stability.analyze", "--out", out, "--results-md", md)
    text = md.read_text()
    for method, lr in (("grpo", AGGRESSIVE_LR), ("dpcc", AGGRESSIVE_LR), ("grpo", BROKEN_LR)):
        assert f"| {lr:g} | {method} | 1 |" in text, text
    assert "Paired comparison with GRPO" in text and f"| {AGGRESSIVE_LR:g} | dpcc | 1 |" in text
    for png in ("collapse_rate.png", "curves.png"):
        assert (md.parent / png).stat().st_size > 1000

    broken = json.loads((out / "results" / f"{run_key('grpo', BROKEN_LR, 1)}.json").read_text())
    assert broken["iterations"] == 5
    assert broken["collapsed"], f"10x the aggressive LR was not flagged: {broken['alerts_by_rule']}"
    assert broken["collapse_rule"] in {"low_entropy", "high_entropy", "non_finite", "reward_collapse"}
