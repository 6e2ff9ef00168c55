"""The planner against layouts NVIDIA publishes for pre-training (numbers quoted in docs/launch.md),
and against the shipped example configs: what the planner accepts, the trainer accepts and runs.

Sources: Megatron-Bridge performance presets (scripts/performance/configs/llama/
llama3_workload_base_configs.py, llama31_workload_base_configs.py): 64 H100s, GBS 128,
MBS 1, sequence 8192 for Llama-3-70B; 1024 H100s, GBS 512 for Llama-3.1-405B.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpcc_megatron.config import load_config
from dpcc_megatron.launch.memory import GIB, Layout, ModelShape, Workload, estimate, peak_stage
from dpcc_megatron.launch.plan import PlanOptions, plan_layout
from dpcc_megatron.testing.shrink import shrink_for_cpu
from dpcc_megatron.train.setup import check_batch_layout

LLAMA3_70B = ModelShape(num_layers=80, hidden=8192, ffn=28672, heads=64, kv_groups=8, head_dim=128, vocab=128256)
LLAMA31_405B = ModelShape(num_layers=126, hidden=16384, ffn=53248, heads=128, kv_groups=8, head_dim=128,
                          vocab=128256)


def pretraining_peak(model, gpus, tp, pp, vpp, cp, global_batch, fp8, recompute="none") -> float:
    """Peak GiB per GPU of a pre-training step (no rollout): SP and the distributed optimizer on."""
    dp = gpus // (tp * pp * cp)
    layout = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, sequence_parallel=tp > 1, distributed_optimizer=True)
    work = Workload(seq_len=8192, micro_batch=1, num_microbatches=global_batch // dp, fp8=fp8, recompute=recompute)
    return peak_stage(estimate(model, layout, work)).peak / GIB


# (name, args, GiB quoted in docs/launch.md, fits in 80 GiB)
CASES = [
    ("70B TP4 PP8 VP5 FP8 (published H100 FP8 preset)", (LLAMA3_70B, 64, 4, 8, 5, 1, 128, True), 74.5, True),
    ("70B TP4 PP8 VP5 BF16", (LLAMA3_70B, 64, 4, 8, 5, 1, 128, False), 80.1, False),
    ("70B TP4 PP4 CP2 VP5 BF16 (published H100 BF16 preset)", (LLAMA3_70B, 64, 4, 4, 5, 2, 128, False), 66.2, True),
    ("70B TP1 PP1 BF16", (LLAMA3_70B, 64, 1, 1, None, 1, 128, False), 583.9, False),
    ("405B TP8 PP8 CP2 VP8 BF16 (published, uneven split)", (LLAMA31_405B, 1024, 8, 8, 8, 2, 512, False), 81.0,
     False),
]


@pytest.mark.parametrize("name, args, quoted, fits", CASES, ids=[c[0] for c in CASES])
def test_pretraining_layouts(name, args, quoted, fits):
    gib = pretraining_peak(*args)
    assert gib == pytest.approx(quoted, abs=0.05), f"{name}: update docs/launch.md ({gib:.1f} GiB)"
    assert (gib <= 80) == fits


def test_llama3_70b_published_layout_fits_and_tp1_pp1_does_not_even_with_full_recompute():
    assert pretraining_peak(LLAMA3_70B, 64, 4, 8, 5, 1, 128, True) < 80
    # Weights and fp32 grads alone are 70.6B x 6 B = 394 GiB on every GPU.
    assert pretraining_peak(LLAMA3_70B, 64, 1, 1, None, 1, 128, False, recompute="full") > 394


# --- the shipped example configs: the planner and the trainer agree on what runs -------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHIPPED = {"qwen25_7b.yaml": 8, "llama3_70b.yaml": 64, "llama31_70b_instruct.yaml": 64, "mistral_large_123b.yaml": 64}
ESTIMATES = re.compile(r"# Planner estimates \(not measured\): peak ([\d.]+) GiB/GPU, ~(\d+) s/iteration, "
                       r"rollout ~(\d+) s, ~(\d+) tokens/s/GPU;\n# printed by `dpcc-megatron plan --config "
                       r"examples/([\w.]+) --gpus (\d+)`")


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_trainer_accepts_the_batch_layout_the_planner_accepts(name):
    cfg = load_config(EXAMPLES / name)
    plan = plan_layout(cfg, PlanOptions(gpus=SHIPPED[name]))
    assert plan.problems == []
    check_batch_layout(cfg, plan.layout.dp)  # the trainer's own checks at the planned DP (raises if not)
    if cfg.parallel.virtual_pipeline_model_parallel_size:
        assert plan.work.num_microbatches % cfg.parallel.pipeline_model_parallel_size == 0


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_shrunk_cpu_layout_of_each_example_is_one_the_planner_accepts(name, tmp_path):
    """tests/train/test_shipped_examples.py trains these; the planner must not call them invalid."""
    cfg, dropped = shrink_for_cpu(load_config(EXAMPLES / name), str(tmp_path))
    par = cfg.parallel
    world = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    plan = plan_layout(cfg, PlanOptions(gpus=world))
    assert plan.problems == [] and plan.layout.dp == 1
    assert plan.layout.sequence_parallel == par.sequence_parallel
    assert plan.layout.vpp == par.virtual_pipeline_model_parallel_size
    check_batch_layout(cfg, plan.layout.dp)


def test_planner_and_trainer_both_refuse_an_interleaved_batch_layout_megatron_cannot_run():
    # Llama-3-70B at DP4, PP2 x VPP5: 72 / (4 x 2) = 9 micro-batches, not a multiple of PP=2.
    cfg = load_config(EXAMPLES / "llama3_70b.yaml", ["train.mini_batch_size=72", "train.micro_batch_size=2",
                                                     "rollout.prompts_per_iteration=72"])
    plan = plan_layout(cfg, PlanOptions(gpus=64))
    assert any("interleaved schedule" in p for p in plan.problems), plan.problems
    with pytest.raises(ValueError, match=r"train\.mini_batch_size.*train\.micro_batch_size"):
        check_batch_layout(cfg, plan.layout.dp)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_example_header_quotes_what_the_planner_prints_now(name):
    """The header's figures are labelled estimates, name the command that prints them, and are what it
    prints today (a planner or config change that moves them fails here until the header follows)."""
    text = (EXAMPLES / name).read_text()
    m = ESTIMATES.search(text.split("\nmodel:", 1)[0])
    assert m, f"{name}: no 'Planner estimates (not measured): ...' header line with its command"
    peak, it, rollout, tps, file, gpus = m.groups()
    assert file == name and int(gpus) == SHIPPED[name]
    plan = plan_layout(load_config(EXAMPLES / name), PlanOptions(gpus=int(gpus)))
    assert plan.fits
    got = (f"{plan.peak_gib:.1f}", f"{plan.time.total_s:.0f}", f"{plan.time.rollout_s:.0f}",
           f"{plan.tokens_per_s_per_gpu:.0f}")
    assert got == (peak, it, rollout, tps), f"{name}: update its header to {got}"


def test_tiny_cpu_header_quotes_no_gpu_estimate_for_a_cpu_run():
    text = (EXAMPLES / "tiny_cpu.yaml").read_text()
    assert "dpcc-megatron plan --config examples/tiny_cpu.yaml --gpus 2" in text and not ESTIMATES.search(text)
