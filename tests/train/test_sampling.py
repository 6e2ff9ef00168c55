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
    import dpcc_megatron.train.trainer as trainer
    from dpcc_megatron.train import sampling

    seen = []
    real = sampling.sample_iteration

    def spy(ctx, iteration):
        s = real(ctx, iteration)
        seen.append((len(s.rollouts.texts), s.rewards.base.view(-1, ctx.cfg.rollout.group_size).tolist(),
                     s.metrics))
        return s

    trainer.sample_iteration = spy
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
