"""Dynamic sampling (rollout.dynamic_sampling): zero-variance groups on the rule track are dropped
and the batch is refilled from later rounds; a batch still short is padded with dropped groups."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.train.sampling import choose_groups, informative_groups

from .test_train_e2e import _cfg


def test_informative_groups_are_judged_on_the_rule_track():
    base = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5])  # groups of 2: (1,1) (1,0) (0,0) (.5,.5)
    assert informative_groups(base, 2).tolist() == [False, True, False, False]


def test_a_batch_with_known_zero_variance_groups_is_refilled_from_later_rounds():
    rounds = [torch.tensor([True, False, False, True]),   # round 0: 2 informative of 4
              torch.tensor([False, True, True, False])]   # round 1: 2 more
    assert choose_groups(rounds, 3) == [(0, 0), (0, 3), (1, 1)]
    assert choose_groups(rounds, 4) == [(0, 0), (0, 3), (1, 1), (1, 2)]
    # still short after the last round: padded with dropped groups, in sampling order
    assert choose_groups(rounds[:1], 4) == [(0, 0), (0, 3), (0, 1), (0, 2)]


def _ds_rank(rank, world, out, overrides):
    import dpcc_megatron.train.async_rollout as async_rollout
    import dpcc_megatron.train.trainer as trainer
    from dpcc_megatron.train import sampling

    seen = []
    real = sampling.sample_iteration

    def spy(ctx, iteration):
        s = real(ctx, iteration)
        seen.append((len(s.rollouts.texts), s.rewards.base.view(-1, ctx.cfg.rollout.group_size).tolist(),
                     s.metrics))
        return s

    async_rollout.sample_iteration = spy
    return trainer.train(_cfg(Path(out), **overrides)), seen


@pytest.mark.multirank
@pytest.mark.slow
def test_dynamic_sampling_keeps_the_batch_layout_and_logs_rounds(tmp_path):
    over = {"rollout.dynamic_sampling": True, "rollout.dynamic_sampling_max_rounds": 3, "train.iterations": 2,
            "parallel.tensor_model_parallel_size": 1}
    results = run_multirank(_ds_rank, 2, args=(str(tmp_path), over), timeout=420)  # DP=2
    for summary, seen in results:
        assert summary["stop_reason"] == "completed" and summary["steps_taken"] == 4
        for n, groups, m in seen:
            assert n == 2 * 4  # this DP rank's share: 2 prompts x G=4, whatever the rounds
            assert m["ds_kept_groups"] + m["ds_padded_groups"] == 4  # all DP ranks: prompts_per_iteration
            assert m["ds_kept_groups"] + m["ds_dropped_groups"] == m["ds_sampled_groups"] == 4 * m["ds_rounds"]
            # kept groups come first, the padding (all-equal rule rewards) after them
            flags = [max(g) != min(g) for g in groups]
            assert flags == sorted(flags, reverse=True)
    for it in range(2):  # the kept count is the informative groups both DP ranks hold
        kept = sum(sum(max(g) != min(g) for g in seen[it][1]) for _, seen in results)
        assert kept == results[0][1][it][2]["ds_kept_groups"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["ds_rounds"] >= 1 and "reward_mean_sampled" in r for r in records)


# -- dynamic sampling without a model: scripted responses, the real reward and batch code ---------------

class _FakeTokenizer:
    pad_id = 0


class _FakeCtx:
    """What sample_iteration reads of a run context, on one rank (DP = TP = PP = 1)."""

    def __init__(self, cfg):
        from dpcc_megatron.data.prompts import PromptDataset, synthetic_prompts
        from dpcc_megatron.rewards import DualTrackReward

        self.cfg, self.dp, self.dp_rank, self.mp_rank, self.mp_group, self.dp_group = cfg, 1, 0, 0, None, None
        self.dataset = PromptDataset(synthetic_prompts("addition", 1, 64, seed=3), seed=3)
        self.reward = DualTrackReward(cfg.reward)
        self.tokenizer = _FakeTokenizer()


def _scripted(plans):
    """make_rollouts replacement: in round r, group g's responses are right ('R') or wrong ('W') by
    plans[r][g]; right answers differ in length, so the contrastive judge tells them apart."""
    from dpcc_megatron.train.rollout import RolloutBatch

    def make(ctx, prompts, iteration, round_index=0):
        G = ctx.cfg.rollout.group_size
        out = {"prompts": [], "texts": []}
        for g, p in enumerate(prompts):
            for j, c in enumerate(plans[min(round_index, len(plans) - 1)][g]):
                ans = p.fields["answer"] if c == "R" else str(int(p.fields["answer"]) + 1)
                out["prompts"].append(p)
                out["texts"].append(" " * j + ans)  # G distinct lengths
        ids = [[3 + (ord(ch) % 50) for ch in t] for t in out["texts"]]
        assert len(ids) == len(prompts) * G
        return RolloutBatch(out["prompts"], [[1, 2]] * len(ids), ids, out["texts"],
                            [torch.full((len(x),), -1.0) for x in ids], [True] * len(ids), 0)

    return make


def _ds_ctx(monkeypatch, plans, **over):
    from dpcc_megatron.config import load_config
    from dpcc_megatron.train import sampling

    base = {"rollout.dynamic_sampling": True, "rollout.dynamic_sampling_max_rounds": 2, "rollout.group_size": 4,
            "rollout.prompts_per_iteration": 2, "rollout.max_new_tokens": 8, "reward.contrastive_gate": "none",
            "reward.dynamic.enabled": True, "train.mini_batch_size": 8, "train.micro_batch_size": 4}
    base.update(over)
    cfg = load_config(overrides=[f"{k}={v}" for k, v in base.items()])
    monkeypatch.setattr(sampling, "make_rollouts", _scripted(plans))
    return _FakeCtx(cfg)


# round 0: group 0 informative, group 1 all right; round 1: both all right -> one kept, one padded group
PLANS = [["RRWW", "RRRR"], ["RRRR", "RRRR"]]


@pytest.mark.parametrize("loss_name", ["grpo", "dapo", "dr_grpo", "dpcc"])
def test_padded_groups_add_nothing_to_the_loss_its_normaliser_or_the_reference_kl(monkeypatch, loss_name):
    from dpcc_megatron.algo import get_policy_loss, group_advantages
    from dpcc_megatron.config import load_config
    from dpcc_megatron.train.sampling import sample_iteration
    from dpcc_megatron.train.update import rl_normalizer

    ctx = _ds_ctx(monkeypatch, PLANS)
    s = sample_iteration(ctx, 0)
    G, cfg = 4, ctx.cfg
    assert s.metrics["ds_kept_groups"] == 1 and s.metrics["ds_padded_groups"] == 1
    pad_total = s.rewards.total[G:]
    assert float(pad_total.max() - pad_total.min()) > 0  # the premise: the contrastive track differs there
    adv, _ = group_advantages(s.rewards.for_advantages, G, cfg.loss.advantage, cfg.loss.advantage_eps)
    assert float(adv[G:].abs().max()) > 0.1  # ... so the padded group gets unit-size advantages
    batch = s.to_batch(adv)
    loss_cfg = load_config(overrides=[f"loss.name={loss_name}", "loss.ref_kl_coef=0.1"]).loss
    torch.manual_seed(0)
    lp_all = (torch.randn(batch.mask.shape) * 0.3 - 1.0)
    ref = torch.randn(batch.mask.shape) * 0.3 - 1.0
    old = lp_all + 0.05 * torch.randn(batch.mask.shape)
    kept = torch.arange(G)

    def run(b, rows):
        lp = lp_all[rows].clone().requires_grad_(True)
        norm = rl_normalizer(b, None, cfg.rollout.max_new_tokens)
        loss, m = get_policy_loss(loss_name)(lp, old[rows], b.advantages, b.mask, loss_cfg, normalizer=norm,
                                             ref_logprobs=ref[rows])
        loss.backward()
        return loss, lp.grad, m, norm

    full = run(batch, torch.arange(2 * G))
    only = run(batch.select(kept), kept)
    assert full[3] == only[3]  # token, sequence and row counts: the padding is not counted
    torch.testing.assert_close(full[0], only[0], rtol=0, atol=0)
    assert torch.equal(full[1][:G], only[1]) and float(full[1][G:].abs().max()) == 0.0
    torch.testing.assert_close(full[2]["ref_kl"], only[2]["ref_kl"], rtol=0, atol=0)


def test_reward_weights_and_counters_advance_once_per_iteration(monkeypatch):
    from dpcc_megatron.train.sampling import sample_iteration

    ctx = _ds_ctx(monkeypatch, PLANS)
    s = sample_iteration(ctx, 0)
    assert s.metrics["ds_rounds"] == 2
    assert ctx.reward.step == 1  # one step for the iteration, not one per round
    # every row's total is combined under the one set of weights the state now holds
    w = ctx.reward.dynamic.weights
    assert s.rewards.weights_dict == w
    expect = w["base"] * s.rewards.base.double() + w["advanced"] * s.rewards.advanced.double()
    torch.testing.assert_close(s.rewards.total.double(), expect, rtol=1e-6, atol=1e-6)
    assert s.rewards.metrics["reward/weight_base"] == w["base"]


def test_the_detectors_rule_track_statistics_describe_everything_sampled(monkeypatch):
    from dpcc_megatron.train.sampling import sample_iteration

    ctx = _ds_ctx(monkeypatch, PLANS)
    s = sample_iteration(ctx, 0)
    # sampled: 4 groups, 3 of them all right (zero variance); the kept batch alone has 1 of 2
    assert s.metrics["zero_var_frac_base"] == pytest.approx(3 / 4)
    wrong = float(s.rewards.base[2])  # a wrong number still earns the format checker's share
    assert 0 <= wrong < 1 and float(s.rewards.base[0]) == 1.0
    sampled_base = torch.tensor([1.0, 1.0, wrong, wrong] + [1.0] * 12, dtype=torch.float64)
    assert s.metrics["reward_base_mean"] == pytest.approx(float(sampled_base.mean()))
    assert s.metrics["reward_base_std"] == pytest.approx(float(sampled_base.std(correction=0)))
