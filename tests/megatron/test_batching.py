"""Token-budget micro-batches: packing, cutting, and putting rows back (pure, no ranks)."""
from __future__ import annotations

import pytest
import torch

from dpcc_megatron.megatron.batching import pack_by_tokens, scatter_rows, token_budget_micro_batches, used_lengths
from dpcc_megatron.megatron.policy_step import RLBatch


def _batch(lengths, L=12):
    n = len(lengths)
    mask = torch.zeros(n, L - 1, dtype=torch.bool)
    for i, length in enumerate(lengths):
        mask[i, 1:length - 1] = True  # prompt of 2 tokens, response up to `length`
    tokens = torch.arange(n * L).view(n, L)
    return RLBatch(tokens=tokens, mask=mask, old_logprobs=torch.randn(n, L - 1), advantages=torch.randn(n))


def test_used_lengths_follow_the_last_response_token():
    b = _batch([12, 5, 3])
    assert used_lengths(b.mask).tolist() == [12, 5, 3]
    assert used_lengths(torch.zeros(1, 6, dtype=torch.bool)).tolist() == [2]


def test_packing_respects_the_budget_longest_first():
    groups = pack_by_tokens([3, 12, 5, 5, 4, 2], max_tokens=12)
    assert groups[0] == [1]  # 12 tokens fill a micro-batch alone
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) * max([3, 12, 5, 5, 4, 2][i] for i in g) <= 12
    assert pack_by_tokens([5, 5], 16, multiple_of=4) == [[0, 1]]  # 2 rows padded to 8: 16 fits
    assert pack_by_tokens([5, 5], 15, multiple_of=4) == [[0], [1]]  # 16 > 15: one row each
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4 is smaller than one sequence"):
        pack_by_tokens([5], 4)


def test_micro_batches_are_cut_and_rows_come_back_in_order():
    b = _batch([12, 5, 3, 5, 4])
    parts, order = token_budget_micro_batches(b, max_tokens=12)
    assert sorted(order.tolist()) == list(range(5))
    for mb in parts:
        assert mb.tokens.shape[1] == int(used_lengths(mb.mask).max())  # its own length, no more
        assert mb.mask.shape[1] == mb.tokens.shape[1] - 1 and mb.old_logprobs.shape == mb.mask.shape
    back = scatter_rows([mb.old_logprobs for mb in parts], order, b.mask.shape[1])
    torch.testing.assert_close(back * b.mask, b.old_logprobs * b.mask)  # every response token back in place
    assert int(sum(mb.mask.sum() for mb in parts)) == int(b.mask.sum())
