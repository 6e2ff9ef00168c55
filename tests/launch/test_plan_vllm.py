"""The planner accounts for the vLLM rollout engine (rollout.engine=vllm): its weight share, KV cache and
sleep state per GPU, and refuses an engine layout whose weight share leaves no KV cache."""
from __future__ import annotations

import dataclasses
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


def test_rollout_time_is_modelled_for_the_engine_that_generates():
    """With rollout.engine=vllm the rollout estimate is the vLLM engine's (tensor parallel over W GPUs, not
    pipelined), and the report says which engine the time is for."""
    from dpcc_megatron.launch.memory import Layout
    from dpcc_megatron.launch.plan import format_plan
    from dpcc_megatron.launch.throughput import Hardware, rollout_time

    cfg = load_config(ROOT / "examples" / "llama3_70b.yaml")
    megatron = plan_layout(cfg, PlanOptions(gpus=64))
    vllm = _plan("llama3_70b.yaml")
    assert megatron.work.engine_workers == 0
    assert "(Megatron engine)" in format_plan(megatron) and "(vLLM TP16 engine, refit not counted)" in format_plan(vllm)
    # the vLLM engine is the Megatron engine's roofline at TP = W, PP = 1
    flat = Layout(tp=16, pp=1, dp=vllm.layout.dp, sequence_parallel=True, distributed_optimizer=True)
    megatron_work = dataclasses.replace(vllm.work, engine_workers=0)
    assert vllm.time.rollout_s == pytest.approx(rollout_time(vllm.model, flat, megatron_work, Hardware()))
    assert vllm.time.rollout_s != pytest.approx(megatron.time.rollout_s)
