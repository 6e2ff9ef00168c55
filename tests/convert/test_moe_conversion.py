"""Qwen3 (QK layernorm), Qwen3-MoE and Mixtral: HF -> Megatron -> HF, logits against the HF forward
at TP, PP and expert-parallel layouts, `convert verify --ep`, and the variants that are refused.

As in test_conversion.py, the conversions run in one child process and all Megatron forwards in
one 2-rank job; the tests below check their results.
"""
import json

import pytest
import torch

from dpcc_megatron.testing import run_multirank

from .hf_models import VOCAB, assert_one_rank_matches_hf, build_hf, read_tensors, run_cli

pytestmark = pytest.mark.multirank

TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
# name -> (family, overrides of the tiny config)
MODELS = {"qwen3": ("qwen3", {}), "qwen3_moe": ("qwen3_moe", {}), "mixtral": ("mixtral", {}),
          # norm_topk_prob=false: top-k of the full softmax, not renormalised (moe_router_pre_softmax)
          "qwen3_moe_raw": ("qwen3_moe", {"norm_topk_prob": False})}
# (model, TP, PP, EP, expert TP) on 2 ranks; the expert grid is carved from TP x DP.
LAYOUTS = [("qwen3", 2, 1, 1, None), ("qwen3_moe", 1, 1, 2, None), ("qwen3_moe", 2, 1, 2, 1),
           ("qwen3_moe", 1, 2, 1, None), ("qwen3_moe_raw", 1, 1, 2, None),
           ("mixtral", 1, 1, 2, None), ("mixtral", 2, 1, 2, 1)]


def _conversions(rank, world, jobs):
    return {name: run_cli(job) for name, job in jobs.items()}


def _forwards(rank, world, cases, tokens):
    from dpcc_megatron.convert.verify import mcore_logits

    return {key: mcore_logits(path, tokens, tp, pp, ep=ep, etp=etp) for key, (path, tp, pp, ep, etp) in cases.items()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    hf = {name: root / name for name in MODELS}
    for name, (family, overrides) in MODELS.items():
        build_hf(family, hf[name], **overrides)
    mc = {name: root / f"{name}_mc" for name in MODELS}
    jobs = {}
    for name in MODELS:
        jobs[f"{name}_to_mcore"] = ["convert", "hf-to-mcore", "--hf", str(hf[name]), "--out", str(mc[name]),
                                    "--no-progress", *(["--ep", "2"] if "moe" in name else [])]
        jobs[f"{name}_to_hf"] = ["convert", "mcore-to-hf", "--mcore", str(mc[name]), "--out", str(root / f"{name}_rt"),
                                 "--no-progress"]
    jobs["ep_too_big"] = ["convert", "hf-to-mcore", "--hf", str(hf["mixtral"]), "--out", str(root / "x"), "--ep", "3"]
    (results,) = run_multirank(_conversions, 1, args=(jobs,), timeout=600)
    for name in MODELS:
        for step in ("to_mcore", "to_hf"):
            rc, _, err = results[f"{name}_{step}"]
            assert rc == 0, f"{name} {step} failed:\n{err[-3000:]}"
    cases = {layout: (str(mc[layout[0]]), *layout[1:]) for layout in LAYOUTS}
    ranks = run_multirank(_forwards, 2, args=(cases, TOKENS), timeout=600)
    return {"root": root, "hf": hf, "mc": mc, "results": results, "ranks": ranks}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "{}-tp{}-pp{}-ep{}-etp{}".format(*lay))
def test_logits_match_hf(work, layout):
    assert_one_rank_matches_hf(work["ranks"], layout, work["hf"][layout[0]], TOKENS)


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bit_identical(work, name):
    src, back = read_tensors(work["hf"][name]), read_tensors(work["root"] / f"{name}_rt")
    assert set(src) == set(back)
    experts = [n for n in src if ".experts." in n]
    assert ("moe" in name or name == "mixtral") == bool(experts)
    for n in src:
        assert torch.equal(src[n], back[n]), n
    cfg = json.loads((work["root"] / f"{name}_rt" / "config.json").read_text())
    assert cfg["architectures"] == [json.loads((work["hf"][name] / "config.json").read_text())["architectures"][0]]


def test_router_variant_is_recorded(work):
    from dpcc_megatron.convert import read_model_config

    renorm, raw = read_model_config(work["mc"]["qwen3_moe"]), read_model_config(work["mc"]["qwen3_moe_raw"])
    assert (renorm.moe_router_pre_softmax, raw.moe_router_pre_softmax) == (False, True)
    assert (renorm.num_moe_experts, renorm.moe_router_topk, renorm.moe_ffn_hidden_size) == (8, 2, 24)
    assert renorm.qk_layernorm and not read_model_config(work["mc"]["mixtral"]).qk_layernorm


def test_refusals_name_the_quantity(work):
    rc, _, err = work["results"]["ep_too_big"]
    assert rc == 1 and "EP=3 does not divide num_moe_experts=4" in err


def test_verify_command_at_ep2(work):
    rc, out, err = run_cli(["convert", "verify", "--hf", str(work["hf"]["mixtral"]), "--mcore",
                            str(work["mc"]["mixtral"]), "--ep", "2", "--seq-len", "8", "--atol", "1e-4"])
    assert rc == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] and report["ep"] == 2 and report["max_abs_logit_diff"] <= 1e-4
