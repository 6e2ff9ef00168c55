"""`dpcc-megatron demo` (the README's first command), with a reduced step count: it writes its
summary and report, and two runs on the same machine give the same summary even when the
sidecar's control advice acts during the run."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# A KL alert threshold every iteration exceeds, so the sidecar advises LR cuts during the run:
# the advice must land at the same iteration in both runs for their summaries to agree.
ADVISED = ["--set", "monitor.kl_threshold=1e-6", "--set", "monitor.kl_window=1", "--set", "monitor.alert_cooldown=3"]


def _demo(out):
    proc = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "demo", "--out", str(out),
                           "--iterations", "8", "--sft-steps", "20", *ADVISED],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_demo_is_reproducible_with_monitor_advice(tmp_path):
    first, second = _demo(tmp_path / "a"), _demo(tmp_path / "b")
    for key in ("reward_before", "reward_after", "iterations", "kl_last", "tau_last", "lr_factor_last", "alerts"):
        assert key in first, key
    assert first["iterations"] == 8
    # held-out evaluation through the eval loop: 64 synthetic prompts, greedy reward and pass@k of 4 samples
    ev = first["eval"]
    assert ev["iteration"] == 8 and ev["prompts"] == 64 and ev["reward_greedy"] == first["reward_after"]
    assert 0 <= ev["pass_at_1"] <= ev["pass_at_2"] <= ev["pass_at_4"] <= 1
    evals = [json.loads(line) for line in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in evals] == [0, 8] and evals[0]["reward_greedy"] == first["reward_before"]
    assert first["lr_scale_from_monitor"] < 1.0 and first["alerts"]  # advice acted during the run
    # the kl_drift alerts behind that advice are warnings, counted as such (the report draws them as ticks)
    counts = first["alerts_by_severity"]
    assert sum(counts.values()) == len(first["alerts"]) and counts["warning"] >= 1
    kl = [a for a in first["alerts"] if a["rule"] == "kl_drift"]
    assert kl and all(a["severity"] == "warning" and not a["confirmed"] for a in kl)
    assert first["advice_fallbacks"] == 0
    assert (tmp_path / "a" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "a" / "monitor.db").stat().st_size > 0  # the sidecar stored the records
    from dpcc_megatron.monitor.store import load_run

    stored = load_run(tmp_path / "a" / "monitor.db", kind="eval")[0]  # the eval records reached the sidecar
    assert [(r["iteration"], r["reward_greedy"]) for r in stored] == [(e["iteration"], e["reward_greedy"])
                                                                     for e in evals]
    first.pop("wall_seconds"), second.pop("wall_seconds")
    assert first == second
