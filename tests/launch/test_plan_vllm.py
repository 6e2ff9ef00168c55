"""The planner accounts for the vLLM rollout engine (rollout.engine=vllm): its weight share, KV cache and
sleep state per GPU, and refuses an engine layout whose weight share leaves no KV cache."""
from __future__ import annotations

from pathlib import Path

import pytest

from dpcc_megatron.config import load_config
from dpcc_megatron.launch.plan import PlanOptions, plan_layout

ROOT = Path(__file__).resolve().parents[2]


def _plan(example: str, *overrides: str):
    cfg = load_config(ROOT / "examples" / example, overrides=["rollout.engine=vllm", *overrides])
    return plan_layout(cfg, PlanOptions(gpus=64))


@pytest.mark.parametrize("example,workers", [("llama3_70b.yaml", 16), ("mistral_large_123b.yaml", 32)])
def test_shipped_vllm_layout_fits_and_a_single_gpu_engine_is_refused(example, workers):
    ok = _plan(example)
    assert ok.work.engine_workers == workers  # the default: one engine spans the replica (TP x PP)
    assert ok.fits, ok.reasons()
    terms = {t.name: t for t in ok.peak.terms}
    engine = terms["vLLM engine (weights + KV)"]
    assert engine.phase == "rollout" and "asleep in training" in engine.why  # sleep_level 2 in the example
    assert "refit buffers" in terms and "rollout KV cache" not in terms  # vLLM's KV cache, not Megatron's

    one = _plan(example, "rollout.vllm.tensor_parallel_size=1")
    assert not one.fits
    assert any(r.startswith("rollout.vllm.tensor_parallel_size=1: each vLLM worker would hold") for r in one.problems)


def test_an_engine_that_never_sleeps_is_resident_through_training():
    awake = _plan("llama3_70b.yaml", "rollout.vllm.sleep_level=0")
    asleep = _plan("llama3_70b.yaml")
    share = 0.2 * 80 * 2**30
    for a, b in zip(awake.stages, asleep.stages):
        assert a.phase("static") == pytest.approx(b.phase("static") + share)
    assert awake.peak_gib > asleep.peak_gib
