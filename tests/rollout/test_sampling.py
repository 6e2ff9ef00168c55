"""Sampling filters and draws: pure functions, checked against hand-computed cases and frequencies."""
import math

import pytest
import torch

from dpcc_megatron.rollout import check_sampling_args, process_logits, sample_tokens, top_k_filter, top_p_filter

NEG = float("-inf")


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.5]])
    out = top_k_filter(logits, 2)
    assert torch.equal(torch.isfinite(out), torch.tensor([[False, True, False, True, False]]))
    assert torch.equal(out[torch.isfinite(out)], torch.tensor([2.0, 3.0]))
    assert torch.equal(top_k_filter(logits, 0), logits)  # 0 disables
    assert torch.equal(top_k_filter(logits, 5), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log().unsqueeze(0)
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.7) == [False, True, False, True]
    assert kept(0.79) == [False, True, False, True]
    assert kept(0.85) == [True, True, False, True]
    assert kept(0.01) == [False, True, False, False]  # the top token always stays
    assert kept(1.0) == [True, True, True, True]


def test_process_logits_order_is_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    out = process_logits(logits, temperature=2.0, top_k=3, top_p=0.6)
    # After T=2 and top-3: softmax of [2, 1.5, 1] = [0.506, 0.307, 0.186]; top-p 0.6 keeps two.
    assert torch.isfinite(out).tolist() == [[True, True, False, False, False]]
    assert torch.allclose(out[0, :2], torch.tensor([2.0, 1.5]))
    with pytest.raises(ValueError, match="temperature"):
        process_logits(logits, temperature=0.0)


def test_greedy_is_argmax_with_point_mass_logprob():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    s = sample_tokens(logits, temperature=0.0)
    assert torch.equal(s.tokens, logits.argmax(-1))
    assert torch.equal(s.logprobs, torch.zeros(6))
    expected = torch.log_softmax(logits, -1).gather(-1, s.tokens[:, None])[:, 0]
    torch.testing.assert_close(s.policy_logprobs, expected)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy(temperature):
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(1))
    s = sample_tokens(logits, temperature=temperature, top_k=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(s.tokens, logits.argmax(-1))
    assert torch.allclose(s.logprobs, torch.zeros(32))


def test_draw_frequencies_follow_the_processed_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 40000
    s = sample_tokens(logits.expand(rows, -1), temperature=0.8, top_k=5, top_p=0.9,
                      generator=torch.Generator().manual_seed(3))
    probs = torch.softmax(process_logits(logits[None], 0.8, 5, 0.9), -1)[0]
    freq = torch.bincount(s.tokens, minlength=6).float() / rows
    assert freq[probs == 0].sum() == 0, "a filtered token was drawn"
    assert (probs == 0).sum() >= 2  # the filters really removed something
    assert torch.allclose(freq, probs, atol=0.01), (freq, probs)
    # Both log-probs are those of the drawn tokens.
    torch.testing.assert_close(s.logprobs, probs.log()[s.tokens])
    torch.testing.assert_close(s.policy_logprobs, torch.log_softmax(logits, -1)[s.tokens])


def test_draws_are_reproducible_from_the_generator():
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(4))
    draw = lambda seed: sample_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(seed)).tokens  # noqa: E731
    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))


def test_bad_arguments_name_themselves():
    for kwargs, name in [(dict(temperature=-1.0, top_p=1.0, top_k=0), "temperature"),
                         (dict(temperature=math.nan, top_p=1.0, top_k=0), "temperature"),
                         (dict(temperature=1.0, top_p=0.0, top_k=0), "top_p"),
                         (dict(temperature=1.0, top_p=1.5, top_k=0), "top_p"),
                         (dict(temperature=1.0, top_p=1.0, top_k=-2), "top_k")]:
        with pytest.raises(ValueError, match=name):
            check_sampling_args(**kwargs)
    with pytest.raises(ValueError, match="Generator"):
        sample_tokens(torch.zeros(1, 3), temperature=1.0)
