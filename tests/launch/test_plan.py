"""`plan` on job configs: layout checks that name the keys, the examples, --search, the CLI contract."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpcc_megatron.cli import main as cli_main
from dpcc_megatron.config import load_config
from dpcc_megatron.launch.plan import PlanOptions, layout_problems, plan_layout, search_layouts
from dpcc_megatron.launch.throughput import Hardware

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

# example -> (GPUs it is written for, GPU memory in GiB)
INTENDED = {"tiny_cpu.yaml": (2, 80), "qwen25_7b.yaml": (8, 80), "llama3_70b.yaml": (64, 80),
            "llama31_70b_instruct.yaml": (64, 80), "mistral_large_123b.yaml": (64, 80),
            "qwen3_30b_a3b.yaml": (8, 141), "qwen3_235b_a22b.yaml": (128, 80)}


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(INTENDED)


@pytest.mark.parametrize("name", sorted(INTENDED))
def test_examples_load_divide_and_fit_as_their_comments_claim(name):
    cfg = load_config(EXAMPLES / name)
    gpus, mem = INTENDED[name]
    plan = plan_layout(cfg, PlanOptions(gpus=gpus, hardware=Hardware(gpu_mem_gib=mem)))
    assert plan.problems == []
    assert plan.fits, plan.reasons()
    text = (EXAMPLES / name).read_text()
    if name != "tiny_cpu.yaml":  # the header quotes the planner's estimate
        assert f"peak {plan.peak_gib:.1f} GiB" in text, plan.peak_gib


def test_example_layouts_are_the_searchs_first_choice():
    for name in ("qwen25_7b.yaml", "llama3_70b.yaml", "mistral_large_123b.yaml"):
        cfg = load_config(EXAMPLES / name)
        gpus, mem = INTENDED[name]
        best = search_layouts(cfg, PlanOptions(gpus=gpus, recompute="none",
                                               hardware=Hardware(gpu_mem_gib=mem)))[0].layout
        p = cfg.parallel
        assert (best.tp, best.pp, best.vpp) == (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                                p.virtual_pipeline_model_parallel_size), name


def llama70b(*overrides):
    return load_config(EXAMPLES / "llama3_70b.yaml", list(overrides))


def test_published_pretraining_layout_fits_and_tp1_pp1_does_not():
    cfg = llama70b()
    ok = plan_layout(cfg, PlanOptions(gpus=64, tp=4, pp=8, vpp=5))
    assert ok.fits and ok.layout.dp == 2 and ok.peak_gib < 80
    bad = plan_layout(cfg, PlanOptions(gpus=64, tp=1, pp=1, vpp=0))
    assert not bad.fits and not bad.problems  # a valid layout that does not fit in memory
    assert bad.layout.sequence_parallel is False  # follows TP down to 1
    (reason,) = bad.reasons()
    assert "> 80 GiB per GPU; largest terms: grads" in reason


@pytest.mark.parametrize("overrides, opts, needle", [
    ([], dict(gpus=60), "60 GPUs are not divisible by TP x PP x CP = 8 x 2 x 1 = 16"),
    (["parallel.tensor_model_parallel_size=16"], dict(gpus=64, pp=1, vpp=0),
     "model.num_query_groups=8 is not divisible by tensor_model_parallel_size=16"),
    ([], dict(gpus=63, tp=3, pp=1, vpp=0),
     "model.num_attention_heads=64 is not divisible by tensor_model_parallel_size=3"),
    ([], dict(gpus=96, pp=3, vpp=0), "model.num_layers=80 is not divisible by pipeline_model_parallel_size=3"),
    ([], dict(gpus=64, vpp=3),
     "model.num_layers=80 is not divisible by pipeline_model_parallel_size=2 x virtual_pipeline_model_parallel_size=3"),
    ([], dict(gpus=64, pp=1), "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1"),
    (["rollout.prompts_per_iteration=66"], dict(gpus=64),
     "rollout.prompts_per_iteration=66 is not divisible by the data-parallel size 4"),
    (["train.mini_batch_size=96"], dict(gpus=64),
     "prompts_per_iteration x group_size = 512 is not a multiple of train.mini_batch_size=96"),
    (["train.mini_batch_size=2"], dict(gpus=64),
     "train.mini_batch_size=2 is not a multiple of data-parallel size 4 x micro-batch 1"),
])
def test_invalid_layouts_are_rejected_naming_the_key(overrides, opts, needle):
    plan = plan_layout(llama70b(*overrides), PlanOptions(**opts))
    assert not plan.fits
    assert any(needle in p for p in plan.problems), plan.problems


def test_context_parallel_needs_a_divisible_sequence():
    cfg = llama70b("rollout.max_new_tokens=3071")  # sequence 4095
    problems = layout_problems(cfg, plan_layout(cfg, PlanOptions(gpus=64, cp=2, pp=1, vpp=0)).layout, 64, 1)
    assert "training sequence 4095 is not divisible by 2 x CP = 4" in problems


def test_recompute_and_micro_batch_move_the_estimate_the_right_way():
    cfg = llama70b()
    base = plan_layout(cfg, PlanOptions(gpus=64))
    full = plan_layout(cfg, PlanOptions(gpus=64, recompute="full"))
    bigger = plan_layout(cfg, PlanOptions(gpus=64, micro_batch=2))
    act = lambda p: next(t.bytes for t in p.stages[0].terms if t.name == "activations")  # noqa: E731
    assert act(full) < act(base) / 10
    assert full.time.step.compute_s > base.time.step.compute_s  # recompute costs a forward
    assert bigger.work.num_microbatches == base.work.num_microbatches // 2
    with pytest.raises(ValueError, match="recompute must be one of"):
        plan_layout(cfg, PlanOptions(gpus=64, recompute="some"))


def test_search_ranks_only_valid_layouts_feasible_first():
    cfg = llama70b()
    plans = search_layouts(cfg, PlanOptions(gpus=64))
    assert plans and all(not p.problems for p in plans)
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)  # every feasible layout before any infeasible one
    speeds = [p.tokens_per_s_per_gpu for p in plans if p.fits]
    assert speeds == sorted(speeds, reverse=True)
    assert {p.layout.tp for p in plans} <= {1, 2, 4, 8}  # TP must divide the 8 K/V groups
    assert all(p.layout.sequence_parallel == (p.layout.tp > 1) for p in plans)


def test_search_finds_nothing_when_nothing_fits():
    plans = search_layouts(llama70b(), PlanOptions(gpus=8))
    assert plans and not any(p.fits for p in plans)
    assert plans[0].peak_gib == min(p.peak_gib for p in plans)


def run_cli(capsys, *argv) -> tuple[int, dict, str]:
    rc = cli_main(["plan", *argv])
    out = capsys.readouterr().out
    return rc, json.loads(out.strip().splitlines()[-1]), out


def test_cli_fits(capsys):
    rc, js, out = run_cli(capsys, "--config", str(EXAMPLES / "llama3_70b.yaml"), "--gpus", "64")
    assert rc == 0 and js["fits"] is True and 40 < js["peak_gib_per_gpu"] < 80
    for term in ("weights", "grads", "optimizer", "activations", "logits + log-prob buffers", "rollout KV cache"):
        assert term in out
    assert (js["tp"], js["pp"], js["vpp"], js["dp"]) == (8, 2, 5, 4)


def test_cli_does_not_fit_exits_1(capsys):
    rc, js, out = run_cli(capsys, "--config", str(EXAMPLES / "llama3_70b.yaml"), "--gpus", "64",
                          "--tp", "1", "--pp", "1", "--vpp", "0")
    assert rc == 1 and js["fits"] is False and js["peak_gib_per_gpu"] > 80
    assert "DOES NOT FIT" in out


def test_cli_invalid_layout_exits_2(capsys):
    rc, js, _ = run_cli(capsys, "--config", str(EXAMPLES / "llama3_70b.yaml"), "--gpus", "64",
                        "--set", "parallel.pipeline_model_parallel_size=3", "--vpp", "0")
    assert rc == 2 and js["fits"] is False
    assert any("num_layers=80 is not divisible" in p for p in js["problems"])


def test_cli_bad_config_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel: {tensor_model_parallel_size: 0}\n")
    rc, js, _ = run_cli(capsys, "--config", str(bad))
    assert rc == 2 and js == {"fits": False, "peak_gib_per_gpu": None,
                              "problems": ["parallel.tensor_model_parallel_size must be >= 1, got 0"]}
    rc, js, _ = run_cli(capsys, "--config", str(EXAMPLES / "tiny_cpu.yaml"), "--gpu-mem-gib", "0")
    assert rc == 2 and "--gpu-mem-gib must be > 0" in js["problems"][0]


def test_cli_search(capsys):
    rc, js, out = run_cli(capsys, "--config", str(EXAMPLES / "qwen25_7b.yaml"), "--gpus", "8", "--search",
                          "--top", "3")
    assert rc == 0 and js["fits"] is True and len(js["layouts"]) == 3
    assert js["peak_gib_per_gpu"] == js["best"]["peak_gib_per_gpu"] == js["layouts"][0]["peak_gib_per_gpu"]
    assert "ranked by modelled RL-iteration throughput" in out
    rc, js, _ = run_cli(capsys, "--config", str(EXAMPLES / "qwen25_7b.yaml"), "--search")
    assert rc == 2 and "--search needs --gpus" in js["problems"][0]


def test_plan_never_imports_torch():
    """It runs on login nodes and in the sbatch preflight, where importing torch costs seconds."""
    import subprocess
    import sys

    code = ("import contextlib, io, sys\n"
            "from dpcc_megatron.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main(['plan', '--config', {str(EXAMPLES / 'llama3_70b.yaml')!r}, '--gpus', '64', '--search'])\n"
            "assert rc == 0, rc\n"
            "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
