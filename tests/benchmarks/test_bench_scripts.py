"""Every benchmark script (``benchmarks/*.py``, found by glob, so a new one is covered the day it lands)
runs in CI in its ``--tiny`` mode: it must accept ``--tiny``, exit 0 and end with one JSON object
carrying its headline figures. A tiny run checks that the script still works against the current
code, not what it measures. The GPU scripts run their CPU dry mode and, without ``--tiny``, refuse
to run on a CPU machine with a message naming the flag.

Budget: a few seconds of work per script; on 2 busy cores most of each run is the interpreter,
Megatron's imports and, for ``bench_rollout.py``, vLLM's start (~1 min together).
"""
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

# The keys each known script's JSON line must carry (finite numbers unless listed under FLAGS).
# A script not listed here still has to end with a non-empty JSON object.
KEYS = {
    "bench_batching.py": ("budget_over_padded_time", "padding_waste_padded", "padding_waste_budget",
                          "padded_s_per_step", "budget_s_per_step"),
    "bench_logprobs.py": ("peak_mem_ratio", "time_ratio"),
    "bench_losses.py": ("grpo_over_grpo", "dpcc_over_grpo"),
    "bench_monitor.py": ("client_ms_per_iter_up", "client_ms_per_iter_down", "sidecar_records_per_s"),
    "bench_rollout.py": ("vllm_over_megatron_tokens_per_s", "refit_over_rollout_time"),
    "bench_step.py": ("dpcc_over_grpo", "grpo_s_per_step", "dpcc_s_per_step", "probe_over_step"),
    "gpu_check.py": ("dpcc_vs_plain",),
    "gpu_loop_check.py": (),
}
# Modules a script needs beyond the base install: without them its tiny run is skipped, saying so.
NEEDS = {"bench_rollout.py": "vllm"}
# The GPU scripts: without --tiny on a machine with no CUDA they must refuse, naming the flag.
GPU_SCRIPTS = ("gpu_check.py", "gpu_loop_check.py")


def _run(args, tmp_path, timeout=900):
    """Run a script in its own process group (vLLM and gloo ranks are its children: a timeout kills
    them all), from a scratch directory, with TMPDIR there so that nothing it leaves outlives the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args[0]} did not finish within {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def _last_json(out: str) -> dict:
    lines = [x for x in out.splitlines() if x.strip()]
    assert lines, "the script printed nothing"
    try:
        obj = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise AssertionError(f"the last line is not JSON ({e}): {lines[-1][:300]}") from None
    assert isinstance(obj, dict) and obj, f"the last line is not a non-empty JSON object: {lines[-1][:300]}"
    return obj


def test_the_glob_finds_every_known_script():
    names = {p.name for p in SCRIPTS}
    assert set(KEYS) <= names, f"listed here but gone from benchmarks/: {sorted(set(KEYS) - names)}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_tiny_mode_runs_and_ends_with_its_json_line(script, tmp_path):
    need = NEEDS.get(script.name)
    if need and importlib.util.find_spec(need) is None:
        pytest.skip(f"{script.name} needs {need}, which is not installed (make test installs it)")
    rc, out, err = _run([script, "--tiny"], tmp_path)
    assert "unrecognized arguments: --tiny" not in err, f"{script.name} must accept --tiny (a few seconds' run)"
    assert rc == 0, f"{script.name} --tiny exited {rc}:\n{out[-2000:]}\n{err[-4000:]}"
    result = _last_json(out)
    for key in KEYS.get(script.name, ()):
        assert key in result, f"{script.name}: {key} missing from {sorted(result)}"
        value = result[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, (key, value)
    check = CHECKS.get(script.name)
    if check:
        check(result)


def _batching(r):
    assert r["steps"] == 1
    # packing rows sorted by length under the same peak size pads less than padding to the longest
    assert 0 <= r["padding_waste_budget"] < r["padding_waste_padded"] < 1


def _losses(r):
    from dpcc_megatron.config.algo import POLICY_LOSSES

    assert set(r) == {f"{name}_over_grpo" for name in POLICY_LOSSES}
    assert r["grpo_over_grpo"] == 1.0


def _monitor(r):
    assert r["delivered_up"] is True  # every record reached the live sidecar
    assert r["spooled_down"] > 0  # with the sidecar down the client spooled instead of blocking


def _step(r):
    assert r["steps"] == 1 and r["dpcc_s_per_step"] > 0 and r["grpo_s_per_step"] > 0


def _gpu_check(r):
    assert r["gpu"] == "cpu (dry check)"
    bf16 = r["modes"]["bf16"]
    assert "error" not in bf16, bf16
    assert math.isfinite(bf16["plain"]["loss"]) and math.isfinite(bf16["dpcc"]["loss"])


def _gpu_loop(r):
    assert r["cuda"] is False and r["ok"] is True, r.get("problems")
    assert r["summary"]["stop_kind"] == "completed" and r["summary"]["iterations"] == 2


def _rollout(r):
    assert r["tp"] == 2  # trainer TP2 with a vLLM TP2 engine
    assert r["sizes"]["tiny"]["vllm_tokens"] == r["sizes"]["tiny"]["megatron_tokens"] == 4 * 2 * 2
    peak = r["refit_peak_extra_over_model"]["tiny"]
    assert math.isfinite(peak) and peak > 0


CHECKS = {"bench_batching.py": _batching, "bench_rollout.py": _rollout, "bench_losses.py": _losses, "bench_monitor.py": _monitor,
          "bench_step.py": _step, "gpu_check.py": _gpu_check, "gpu_loop_check.py": _gpu_loop}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_scripts_refuse_a_cpu_machine_naming_the_dry_mode(name, tmp_path):
    rc, out, err = _run([ROOT / "benchmarks" / name], tmp_path, timeout=300)
    assert rc != 0
    assert "no CUDA device" in err and "--tiny" in err, err[-2000:]
