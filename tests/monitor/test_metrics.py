"""Trainer-side metric functions (pure python and torch variants agree)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpcc_megatron.monitor.metrics import (batch_repetition, entropy_fraction, group_distinct_fraction,
                                           language_consistency, longest_repeat, ngram_repeat_share, perplexity,
                                           repetition_stats, response_metrics)


def test_repetition_definitions():
    assert ngram_repeat_share([1, 2, 3, 1, 2, 3], 3) == pytest.approx(1 - 3 / 4)
    assert ngram_repeat_share([1, 2], 3) is None
    assert longest_repeat("abcabcabc") == 9
    assert longest_repeat("xyzabab") == 4
    assert longest_repeat("abcdefg") == 0
    st0 = repetition_stats("0000000000")
    assert st0["rep_3gram"] == pytest.approx(7 / 8) and st0["rep_4gram"] == pytest.approx(6 / 7)
    assert st0["longest_repeat"] == 10
    clean = repetition_stats("12+34=46")
    assert clean["repetition_rate"] == 0.0 and clean["longest_repeat"] == 0


def test_batch_repetition_mean_and_max():
    out = batch_repetition(["0000000000", "12+34=46", "ab"])
    assert out["repetition_rate"] == pytest.approx((repetition_stats("0000000000")["repetition_rate"] + 0.0) / 2)
    assert out["longest_repeat"] == 10


seqs = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=24), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(seqs)
def test_torch_repetition_matches_python(batch):
    torch = pytest.importorskip("torch")
    from dpcc_megatron.monitor.metrics import repetition_stats_torch

    T = max(1, max(len(s) for s in batch))
    x = torch.zeros(len(batch), T, dtype=torch.long)
    m = torch.zeros(len(batch), T, dtype=torch.bool)
    for i, s in enumerate(batch):
        x[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        m[i, :len(s)] = True
    got = repetition_stats_torch(x, m)
    want = batch_repetition(batch)
    assert got["longest_repeat"] == want["longest_repeat"]
    assert got["repetition_rate"] == pytest.approx(want["repetition_rate"], abs=1e-9)


def test_language_consistency():
    assert language_consistency(["hello world", "the answer is 42"]) == 1.0
    mixed = language_consistency(["hello", "привет"], expected="latin")
    assert mixed == pytest.approx(0.5)
    assert language_consistency(["答案是 42", "答案 is"], expected="han") == pytest.approx((1.0 + 2 / 4) / 2)
    assert language_consistency(["1234", "+-"]) == 1.0  # no letters at all
    assert language_consistency(["こんにちは世界"], expected=("han", "hiragana", "katakana")) == 1.0


def test_perplexity_and_entropy_fraction():
    assert perplexity([-1.0, -3.0]) == pytest.approx(math.e ** 2)
    assert perplexity([[-1.0, -2.0], [-3.0, -100.0]], [[1, 1], [1, 0]]) == pytest.approx(math.e ** 2)
    assert math.isnan(perplexity([[-1.0]], [[0]]))
    assert math.isfinite(perplexity([-1e6]))  # clamped, so non_finite only fires on real NaN/Inf
    assert entropy_fraction(math.log(100), 100) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        entropy_fraction(1.0, 1)


def test_torch_entropy_and_perplexity():
    torch = pytest.importorskip("torch")
    from dpcc_megatron.monitor.metrics import perplexity_torch, token_entropy_torch

    logits = torch.zeros(2, 3, 50)
    assert token_entropy_torch(logits) == pytest.approx(math.log(50), rel=1e-5)
    peaked = torch.full((1, 2, 50), -1e4)
    peaked[..., 0] = 0
    mask = torch.tensor([[1, 0]])
    assert token_entropy_torch(peaked, mask) == pytest.approx(0.0, abs=1e-6)
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -100.0]])
    assert perplexity_torch(lp, torch.tensor([[1, 1], [1, 0]])) == pytest.approx(math.e ** 2)


def test_response_metrics_bundle():
    out = response_metrics(texts=["0000000000", "hello"], logprobs=[-1.0, -1.0], entropy=2.0, vocab_size=64)
    assert out["repetition_rate"] == pytest.approx(batch_repetition(["0000000000", "hello"])["repetition_rate"])
    assert out["repetition_rate"] > 0.4 and out["longest_repeat"] == 10
    assert out["language_consistency"] == 1.0 and out["perplexity"] == pytest.approx(math.e)
    assert out["entropy_frac"] == pytest.approx(2.0 / math.log(64))


def test_batch_repetition_subsample():
    seqs = ["0000000000"] * 50 + ["abcdefghij"] * 50
    sub = batch_repetition(seqs, max_seqs=10)
    assert sub["repetition_rate"] == pytest.approx(batch_repetition(seqs)["repetition_rate"])
    assert batch_repetition(["0000000000"] + ["abcdefghij"] * 99, max_seqs=10)["longest_repeat"] == 10


def test_group_distinct_fraction():
    # two groups of 4: all different (4/4) and one answer four times (1/4)
    seqs = [[1], [2], [3], [4], [7, 0], [7, 0], [7, 0], [7, 0]]
    assert group_distinct_fraction(seqs, 4) == pytest.approx((4 + 1) / 8)
    assert group_distinct_fraction(["ab", "ab", "a", "b"], 2) == pytest.approx((1 + 2) / 4)
    assert group_distinct_fraction([], 4) is None
    with pytest.raises(ValueError, match="whole groups"):
        group_distinct_fraction([[1], [2], [3]], 2)
    with pytest.raises(ValueError, match="group_size"):
        group_distinct_fraction([[1]], 0)
