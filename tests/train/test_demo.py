"""`dpcc-megatron demo` (the README's first command), with reduced step counts: GRPO and DPCC from one
warm-start, its summary (both methods) and side-by-side report, and two demos on the same machine give
the same summary even when the sidecar's control advice acts during the runs, at TP=2."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# A KL alert threshold every iteration exceeds, with control on, so the sidecar advises LR cuts during
# each run: the advice must land at the same iteration in both demos for their summaries to agree.
ADVISED = ["--set", "monitor.control_enabled=true", "--set", "monitor.kl_threshold=1e-6", "--set",
           "monitor.kl_window=1", "--set", "monitor.alert_cooldown=3", "--set", "parallel.tensor_model_parallel_size=2"]


def _demo(out):
    proc = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "demo", "--out", str(out),
                           "--iterations", "4", "--sft-steps", "10", *ADVISED],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_demo_compares_grpo_and_dpcc_from_one_warm_start_reproducibly(tmp_path):
    first, second = _demo(tmp_path / "a"), _demo(tmp_path / "b")
    assert first["lr"] == 2e-3 and first["seed"] == 1234 and first["iterations"] == 4
    assert set(first["methods"]) == {"grpo", "dpcc"}
    grpo, dpcc = first["methods"]["grpo"], first["methods"]["dpcc"]
    for m in (grpo, dpcc):
        for key in ("reward_before", "reward_after", "collapsed", "collapse_iteration", "label", "eval",
                    "kl_last", "tau_last", "lr_factor_last", "alerts"):
            assert key in m, key
        assert isinstance(m["collapsed"], bool) and m["iterations"] == 4
        # held-out evaluation through the eval loop: 64 synthetic prompts, greedy reward and pass@k of 4 samples
        ev = m["eval"]
        assert ev["iteration"] == 4 and ev["prompts"] == 64 and ev["reward_greedy"] == m["reward_after"]
        assert 0 <= ev["pass_at_1"] <= ev["pass_at_2"] <= ev["pass_at_4"] <= 1
        assert m["lr_scale_from_monitor"] < 1.0 and m["alerts"]  # advice acted during the run
        assert m["advice_fallbacks"] == 0
    # one warm-start: both methods start from the same policy, so the same held-out greedy reward
    assert grpo["reward_before"] == dpcc["reward_before"]
    for method in ("grpo", "dpcc"):
        evals = [json.loads(line) for line in (tmp_path / "a" / method / "eval.jsonl").read_text().splitlines()]
        assert [e["iteration"] for e in evals] == [0, 4] and evals[0]["reward_greedy"] == first["methods"][method][
            "reward_before"]
        assert (tmp_path / "a" / method / "monitor.db").stat().st_size > 0  # its sidecar stored the records
    cfg = {m: (tmp_path / "a" / m / "config.yaml").read_text() for m in ("grpo", "dpcc")}
    assert "name: grpo" in cfg["grpo"] and "name: dpcc" in cfg["dpcc"]
    assert (tmp_path / "a" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first.pop("wall_seconds"), second.pop("wall_seconds")
    first.pop("warm_start"), second.pop("warm_start")
    assert first == second


def test_demo_summary_marks_a_collapse_by_the_labelling_rule(tmp_path):
    from dpcc_megatron.commands.demo import method_summary

    def write(run_dir, rewards, loss):
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(f"loss:\n  name: {loss}\n")
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"iteration": i, "kind": "train", "reward_base_mean": r, "entropy": 0.8, "tau": 1.05})
            + "\n" for i, r in enumerate(rewards)))
        (run_dir / "train_summary.json").write_text(json.dumps({
            "reward_before": 0.3, "reward_after": 0.1 if rewards[-1] < 0.1 else 0.35, "stop_reason": "completed",
            "iterations": len(rewards), "alerts": [{"rule": "kl_drift", "iteration": 1, "severity": "critical",
                                                    "confirmed": True}]}))

    write(tmp_path / "grpo", [0.4] * 4 + [0.02] * 8, "grpo")
    write(tmp_path / "dpcc", [0.4] * 12, "dpcc")
    down, run = method_summary(tmp_path / "grpo")
    assert down["collapsed"] and down["collapse_iteration"] == 5 and run.collapse_onset == 5  # the 3-iteration mean halves
    assert down["monitor_first_critical"] == {"iteration": 1, "rule": "kl_drift"}
    assert run.fixed == {"tau": 1.2}  # GRPO's ratio bound is fixed at 1 + clip_eps, not the recorded tau
    flat, run = method_summary(tmp_path / "dpcc")
    assert not flat["collapsed"] and flat["label"] == "healthy" and run.fixed == {}
