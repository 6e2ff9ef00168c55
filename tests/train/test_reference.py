"""The frozen reference policy (loss.ref_kl_coef > 0): built at the policy's layout, it supplies
ref_logprobs, the record carries kl_ref, it stays bit-identical through training and resume, the
penalty pulls the policy toward it, and the planner budgets exactly what is built."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpcc_megatron.algo import get_policy_loss
from dpcc_megatron.config import LossConfig
from dpcc_megatron.testing import run_multirank

from .test_train_e2e import _cfg

REF = {"loss.ref_kl_coef": 0.5, "loss.kl_estimator": "k3", "optim.lr": 3e-3}


def _ref_rank(rank, world, out, overrides):
    import dpcc_megatron.train.trainer as trainer
    from dpcc_megatron.launch.plan import PlanOptions, plan_layout

    seen = {}
    real_setup = trainer.setup_run

    def setup(cfg):
        ctx = real_setup(cfg)
        seen["ctx"] = ctx
        return ctx

    real_build = trainer.build_rl_optimizer

    def build_rl_optimizer(ctx, total):  # RL starts here: the policy as the reference must be
        seen["policy_at_rl_start"] = [p.detach().clone() for c in ctx.chunks for p in c.parameters()]
        return real_build(ctx, total)

    trainer.setup_run, trainer.build_rl_optimizer = setup, build_rl_optimizer
    cfg = _cfg(Path(out), **overrides)
    summary = trainer.train(cfg)
    ref = seen["ctx"].reference
    stage = plan_layout(cfg, PlanOptions(gpus=world)).stages[0]
    planned = {t.name: t.bytes for t in stage.terms}.get("reference weights")
    return {"summary": summary, "ref": [p.detach().clone() for c in ref.chunks for p in c.parameters()],
            "policy_at_rl_start": seen.get("policy_at_rl_start"),
            "policy": [p.detach().clone() for c in seen["ctx"].chunks for p in c.parameters()],
            "ref_bytes": ref.param_bytes(), "planned_bytes": planned,
            "ref_requires_grad": any(p.requires_grad for c in ref.chunks for p in c.parameters())}


@pytest.mark.multirank
@pytest.mark.slow
def test_reference_trains_logs_kl_ref_and_survives_resume_bit_identical(tmp_path):
    """Also: a dynamic-sampling run resumes exactly."""
    # dynamic sampling rides along: its extra rounds move the prompt stream, which resume must restore
    # the penalty's estimator differs from the drift KL's (loss.dpcc.kl_estimator, k3), so the record must name it
    common = {**REF, "loss.kl_estimator": "k2", "train.iterations": 4, "checkpoint.save_interval": 2,
              "checkpoint.keep_last": 2, "rollout.dynamic_sampling": True}
    straight = tmp_path / "straight"
    (a,) = run_multirank(_ref_rank, 1, args=(str(straight), {**common, "checkpoint.dir": str(straight / "ck")}),
                         timeout=300)
    assert a["summary"]["stop_reason"] == "completed"
    assert not a["ref_requires_grad"]
    # the reference is the policy as RL started (after the warm-start), unchanged by training
    assert all(torch.equal(r, p) for r, p in zip(a["ref"], a["policy_at_rl_start"]))
    assert any(not torch.equal(r, p) for r, p in zip(a["ref"], a["policy"]))  # the policy moved away
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    # kl_ref is measured on every iteration that kept a group (one whose groups were all padding has none)
    measured = [r for r in records if r["entropy"] is not None]
    assert measured and all(r["kl_ref"] is not None for r in measured) and measured[-1]["kl_ref"] > 0
    assert all(r["kl_ref"] is None for r in records if r["entropy"] is None)
    # the record names the penalty's estimator (loss.kl_estimator), which the monitor's kl_ref alerts quote
    assert {r["kl_ref_estimator"] for r in records} == {"k2"} and {r["kl_estimator"] for r in records} == {"k3"}
    assert a["ref_bytes"] == a["planned_bytes"]  # the planner budgets what is built

    split = tmp_path / "split"
    over = {**common, "checkpoint.dir": str(split / "ck"), "train.exit_interval": 2}
    run_multirank(_ref_rank, 1, args=(str(split), over), timeout=300)
    (b,) = run_multirank(_ref_rank, 1, args=(str(split), over), timeout=300)
    assert b["summary"]["iterations"] == 4
    assert all(torch.equal(x, y) for x, y in zip(a["ref"], b["ref"]))  # restored bit for bit
    resumed = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    for ra, rb in zip(records[2:], resumed):
        for k in ("kl_ref", "pg_loss", "kl_old_new", "ds_rounds", "reward_mean_sampled"):
            assert (ra[k] is None and rb[k] is None) or abs(ra[k] - rb[k]) <= 1e-6, (k, ra[k], rb[k])


@pytest.mark.multirank
@pytest.mark.slow
def test_offloaded_reference_gives_the_same_run(tmp_path):
    over = {**REF, "train.iterations": 2}
    (a,) = run_multirank(_ref_rank, 1, args=(str(tmp_path / "a"), over), timeout=300)
    (b,) = run_multirank(_ref_rank, 1, args=(str(tmp_path / "b"), {**over, "loss.ref_offload": True}), timeout=300)
    assert all(torch.equal(x, y) for x, y in zip(a["policy"], b["policy"]))
    assert b["planned_bytes"] is None and b["ref_bytes"] > 0  # offloaded: not in the training peak


def test_the_penalty_pulls_the_policy_toward_the_reference():
    """Zero advantages, only coef * KL(pi_theta || pi_ref): gradient steps on-policy shrink the exact KL."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(8, generator=g, dtype=torch.float64), -1)
    cfg = LossConfig(ref_kl_coef=1.0, kl_estimator="k3")
    loss_fn = get_policy_loss("grpo")

    def exact_kl():
        lp = torch.log_softmax(logits, -1)
        return float((lp.exp() * (lp - ref)).sum())

    before = exact_kl()
    opt = torch.optim.SGD([logits], lr=0.5)
    for _ in range(30):
        lp = torch.log_softmax(logits, -1)
        tokens = torch.multinomial(lp.exp().detach(), 256, replacement=True, generator=g)
        sample_lp = lp[tokens].view(16, 16)
        loss, _ = loss_fn(sample_lp, sample_lp.detach(), torch.zeros(16), torch.ones(16, 16, dtype=torch.bool), cfg,
                          ref_logprobs=ref[tokens].view(16, 16))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert exact_kl() < 0.2 * before


def test_reference_keys_need_a_coefficient():
    from dpcc_megatron.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="loss.ref_model_path is set but ref_kl_coef is 0"):
        load_config(overrides=["loss.ref_model_path=/x"])
    with pytest.raises(ConfigError, match="loss.ref_offload is set but ref_kl_coef is 0"):
        load_config(overrides=["loss.ref_offload=true"])
