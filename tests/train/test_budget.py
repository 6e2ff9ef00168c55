"""train.max_tokens_per_micro_batch end to end: the same run as the padded path (old log-probs put
back in place, same updates), and a budget below one sequence is refused at load."""
from __future__ import annotations

import json

import pytest

from dpcc_megatron.config import ConfigError, load_config
from dpcc_megatron.testing import run_multirank

from .test_train_e2e import _run_rank


@pytest.mark.multirank
@pytest.mark.slow
def test_token_budget_run_equals_the_padded_run(tmp_path):
    base = {"train.iterations": 2, "data.max_prompt_len": 8}
    run_multirank(_run_rank, 1, args=(str(tmp_path / "padded"), base), timeout=300)
    run_multirank(_run_rank, 1, args=(str(tmp_path / "budget"), {**base, "train.max_tokens_per_micro_batch": 24}),
                  timeout=300)
    a = [json.loads(x) for x in (tmp_path / "padded" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "budget" / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for k in ("reward_mean", "pg_loss", "kl_old_new", "entropy", "perplexity", "mismatch_kl", "grad_norm"):
            assert abs(ra[k] - rb[k]) <= 1e-5 * max(1.0, abs(ra[k])), (k, ra[k], rb[k])


def test_a_budget_below_one_sequence_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="train.max_tokens_per_micro_batch must be 0 or hold one sequence"):
        load_config(overrides=["train.max_tokens_per_micro_batch=20", "data.max_prompt_len=16",
                               "rollout.max_new_tokens=8"])
