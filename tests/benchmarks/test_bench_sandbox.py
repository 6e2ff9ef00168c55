"""benchmarks/bench_sandbox.py --tiny: every available mode scores the same samples alike, and the
figures come out as one JSON line."""
import json

from benchmarks.bench_sandbox import main


def test_bench_sandbox_tiny(capsys):
    result = main(["--tiny"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["bench"] == "sandbox" and result["tiny"]
    assert result["verdicts_agree"]
    assert result["passed_total"] == 6  # add and fib: 3 asserts each, passed by the honest solutions only
    assert {"none", "namespaces"} <= set(result["runs_per_s"])  # this host has user namespaces
    assert all(r > 0 for r in result["runs_per_s"].values())
    assert result["ratio_to_none"]["none"] == 1.0
