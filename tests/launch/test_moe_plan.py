"""The planner's mixture-of-experts terms, and the Qwen3-MoE example configs it is quoted for."""
from pathlib import Path

import pytest

from dpcc_megatron.config import load_config
from dpcc_megatron.launch.memory import Layout, ModelShape, Workload, estimate, stage_expert_params
from dpcc_megatron.launch.plan import PlanOptions, model_shape, plan_layout
from dpcc_megatron.launch.throughput import Hardware
from dpcc_megatron.train.setup import check_batch_layout

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QWEN3_30B_A3B = ModelShape(num_layers=48, hidden=2048, ffn=6144, heads=32, kv_groups=4, head_dim=128, vocab=151936,
                           experts=128, topk=8, expert_ffn=768, qk_norm=True)


def _terms(model, layout, **work):
    (stage,) = estimate(model, layout, Workload(seq_len=4096, micro_batch=1, num_microbatches=8, **work))
    return {t.name: t.bytes for t in stage.terms}


def test_published_parameter_counts():
    # Qwen3-30B-A3B: 30.5B total, 3.3B activated; Qwen3-235B-A22B: 235B total, 22B activated (model cards).
    m = QWEN3_30B_A3B
    assert m.total_params() / 1e9 == pytest.approx(30.5, abs=0.1)
    active = m.total_params() - m.num_layers * (m.expert_params_per_layer() - m.topk * m.one_expert_params())
    assert active / 1e9 == pytest.approx(3.3, abs=0.1)
    big = model_shape(load_config(EXAMPLES / "qwen3_235b_a22b.yaml").model)
    assert big.total_params() / 1e9 == pytest.approx(235, abs=0.5)


def test_expert_terms_follow_ep_and_the_expert_data_parallel_group():
    ep8 = _terms(QWEN3_30B_A3B, Layout(dp=8, ep=8))
    ep4 = _terms(QWEN3_30B_A3B, Layout(dp=8, ep=4))
    # Half the EP: twice the experts per GPU (weights, grads), the same optimizer bytes (sharded over 2).
    assert ep4["expert weights"] == pytest.approx(2 * ep8["expert weights"])
    assert ep4["expert grads"] == pytest.approx(2 * ep8["expert grads"])
    assert ep4["expert optimizer"] == pytest.approx(ep8["expert optimizer"])
    assert stage_expert_params(QWEN3_30B_A3B, Layout(dp=8, ep=8)) == 48 * 16 * 2048 * 768 * 3
    # 12 B of Adam state per expert param (fp32 main + m + v), nothing sharded at expert DP 1.
    assert ep8["expert optimizer"] == pytest.approx(12 * stage_expert_params(QWEN3_30B_A3B, Layout(dp=8, ep=8)))
    # All-to-all buffers: send + receive of s x top-k routed tokens x hidden, bf16.
    assert ep8["all-to-all buffers"] == 2 * 4096 * 8 * 2048 * 2
    dense = ModelShape(num_layers=48, hidden=2048, ffn=6144, heads=32, kv_groups=4, head_dim=128, vocab=151936)
    assert not {"expert weights", "all-to-all buffers"} & set(_terms(dense, Layout(dp=8)))


def test_routed_activations_grow_with_top_k():
    top1 = ModelShape(**{**QWEN3_30B_A3B.__dict__, "topk": 1})
    assert _terms(QWEN3_30B_A3B, Layout(dp=8, ep=8))["activations"] > 2 * _terms(top1, Layout(dp=8, ep=8))["activations"]


@pytest.mark.parametrize("name,gpus,mem,fits,peak", [("qwen3_30b_a3b.yaml", 8, 141, True, 105.17),
                                                     ("qwen3_30b_a3b.yaml", 8, 80, False, 105.17),
                                                     ("qwen3_235b_a22b.yaml", 128, 80, True, 64.78)])
def test_examples_have_the_quoted_planner_figures(name, gpus, mem, fits, peak):
    cfg = load_config(EXAMPLES / name)
    plan = plan_layout(cfg, PlanOptions(gpus=gpus, hardware=Hardware(gpu_mem_gib=mem)))
    assert plan.problems == [] and plan.fits == fits
    assert plan.peak_gib == pytest.approx(peak, abs=0.01), "update the figures in the example's header"
    check_batch_layout(cfg, plan.layout.dp)


def test_expert_layout_problems_name_the_keys():
    cfg = load_config(EXAMPLES / "qwen3_30b_a3b.yaml")
    problems = plan_layout(cfg, PlanOptions(gpus=8, ep=3)).problems
    assert any("num_moe_experts=128 is not divisible by expert_model_parallel_size=3" in p for p in problems)
    problems = plan_layout(cfg, PlanOptions(gpus=8, tp=2, sequence_parallel=False, ep=4)).problems
    assert any("needs sequence_parallel" in p for p in problems)
    problems = plan_layout(cfg, PlanOptions(gpus=4, ep=8)).problems
    assert any("does not divide the 4 GPUs" in p for p in problems)


@pytest.mark.parametrize("name,gpus,experts_gib", [("qwen3_30b_a3b.yaml", 8, 1.125),
                                                    ("qwen3_235b_a22b.yaml", 128, 4.5)])
def test_vllm_refit_bucket_holds_one_layers_experts(name, gpus, experts_gib):
    """A layer's experts are one vLLM module, so one bucket: the refit term takes max(refit_bucket_mb, one
    layer's experts in the serving dtype), here bf16 (128 experts x 3 x hidden x expert width x 2 B)."""
    from dpcc_megatron.launch.memory import GIB, refit_unit_params

    def refit(*overrides):
        cfg = load_config(EXAMPLES / name, overrides=["rollout.engine=vllm", *overrides])
        plan = plan_layout(cfg, PlanOptions(gpus=gpus))
        return plan, {t.name: t for t in plan.peak.terms}["refit buffers"]

    plan, term = refit("rollout.vllm.refit_bucket_mb=512")
    unit = 2 * refit_unit_params(plan.model) * 2
    assert plan.model.expert_params_per_layer() * 2 / GIB == pytest.approx(experts_gib)
    assert term.bytes == pytest.approx(experts_gib * GIB + unit) and "experts" in term.why
    _, big = refit(f"rollout.vllm.refit_bucket_mb={int(2 * experts_gib * 1024)}")  # the key wins when larger
    assert big.bytes == pytest.approx(2 * experts_gib * GIB + unit) and "experts" not in big.why
