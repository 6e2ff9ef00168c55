"""KL estimators against exact expectations, and the reference-KL penalty."""
from __future__ import annotations

import math

import pytest
import torch

from dpcc_megatron.algo import KL_ESTIMATORS, LossNormalizer, get_policy_loss, kl_terms, kl_token_mean, ref_kl_penalty
from dpcc_megatron.config.algo import LossConfig

from .helpers import grad_of, make_batch


def test_terms_match_formulas():
    p = torch.tensor([[-0.5, -2.0, -1.0]], dtype=torch.float64)
    q = torch.tensor([[-0.7, -1.0, -1.0]], dtype=torch.float64)
    for est, f in (("k1", lambda x: -x), ("k2", lambda x: 0.5 * x * x), ("k3", lambda x: math.exp(x) - 1 - x)):
        expected = [f(b - a) for a, b in zip(p[0].tolist(), q[0].tolist())]
        assert kl_terms(p, q, est)[0].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_k1_and_k3_are_unbiased_under_exact_expectation():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    true_kl = float((logp.exp() * (logp - logq)).sum())
    for est in ("k1", "k3"):
        expectation = float((logp.exp() * kl_terms(logp[None], logq[None], est)[0]).sum())
        assert expectation == pytest.approx(true_kl, rel=1e-10)
    k2 = float((logp.exp() * kl_terms(logp[None], logq[None], "k2")[0]).sum())
    assert k2 > 0 and k2 != pytest.approx(true_kl, rel=1e-3)  # k2 is biased


def test_clamp_keeps_terms_finite_and_k3_nonnegative():
    p = torch.tensor([[0.0, 0.0, -5.0]], dtype=torch.float32)
    q = torch.tensor([[-300.0, 300.0, -5.0]], dtype=torch.float32)
    for est in KL_ESTIMATORS:
        t = kl_terms(p, q, est)
        assert torch.isfinite(t).all()
    k3 = kl_terms(p, q, "k3")
    assert (k3 >= 0).all() and float(k3[0, 1]) == pytest.approx(math.exp(20) - 21, rel=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_terms(p, q, "k4")


def test_kl_token_mean_ignores_masked_tokens():
    p = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[-1.5, 7.0], [-1.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[True, False], [True, False]])
    expected = ((math.exp(-0.5) - 1 + 0.5) + (math.exp(1.0) - 1 - 1.0)) / 2
    assert float(kl_token_mean(p, q, mask)) == pytest.approx(expected)
    assert float(kl_token_mean(p, q, torch.zeros_like(mask))) == 0.0


def test_ref_penalty_value_and_gradient():
    lp, _, _, mask = make_batch(40)
    ref = lp.detach() + torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=lp.dtype) * 0.3
    leaf = lp.clone().requires_grad_(True)
    penalty, kl = ref_kl_penalty(leaf, ref, mask, coef=0.5, estimator="k3")
    penalty.backward()
    x = (ref - lp)[mask]
    n = int(mask.sum())
    assert float(penalty) == pytest.approx(0.5 * float((torch.expm1(x) - x).sum()) / n)
    assert float(kl) == pytest.approx(float((torch.expm1(x) - x).sum()) / n)
    # value from k3; gradient sg(log pi_theta - log pi_ref) * grad log pi_theta = -x per token
    expected = torch.zeros_like(lp)
    expected[mask] = 0.5 * (-x) / n
    torch.testing.assert_close(leaf.grad, expected)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_ref_penalty_gradient_is_that_of_kl_theta_ref_in_expectation(estimator):
    """Over a categorical pi_theta, E_{x~pi_theta}[grad penalty(x)] equals grad KL(pi_theta || pi_ref)
    exactly, for every estimator (a differentiated k3 term would give grad KL(pi_ref || pi_theta))."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(logits, -1)
    exact = (lp.exp() * (lp - ref)).sum()
    (want,) = torch.autograd.grad(exact, logits, retain_graph=True)
    one = torch.ones(1, 1, dtype=torch.bool)
    expectation = sum(lp[x].exp().detach() * ref_kl_penalty(lp[x].view(1, 1), ref[x].view(1, 1), one, 1.0, estimator)[0]
                      for x in range(6))
    (got,) = torch.autograd.grad(expectation, logits, retain_graph=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    reverse = (ref.exp() * (ref - lp)).sum()  # KL(pi_ref || pi_theta): a different gradient
    (other,) = torch.autograd.grad(reverse, logits)
    assert not torch.allclose(got, other, atol=1e-3)


@pytest.mark.parametrize("name", ["grpo", "dpcc", "dr_grpo"])
def test_policy_loss_adds_the_penalty_with_its_own_aggregation(name):
    lp, old, adv, mask = make_batch(41)
    ref = old - 0.2
    plain, _ = get_policy_loss(name)(lp, old, adv, mask)
    cfg = LossConfig(ref_kl_coef=0.25, kl_estimator="k2")
    with_kl, metrics = get_policy_loss(name)(lp, old, adv, mask, cfg, ref_logprobs=ref)
    aggregation = get_policy_loss(name).aggregation
    penalty, kl = ref_kl_penalty(lp, ref, mask, 0.25, "k2", aggregation)
    assert float(with_kl) == pytest.approx(float(plain) + float(penalty), rel=1e-12)
    assert float(metrics["ref_kl_loss"]) == pytest.approx(float(penalty))
    assert float(metrics["ref_kl"]) == pytest.approx(float(kl))
    assert float(penalty) > 0
    with pytest.raises(ValueError, match="ref_logprobs"):
        get_policy_loss(name)(lp, old, adv, mask, cfg)


def test_penalty_contributions_with_normalizer():
    lp, _, _, mask = make_batch(42, B=8)
    ref = lp - 0.3
    norm = LossNormalizer.from_mask(mask)
    full, _ = ref_kl_penalty(lp, ref, mask, 1.0)
    parts = sum(float(ref_kl_penalty(lp[a:b], ref[a:b], mask[a:b], 1.0, normalizer=norm)[0]) for a, b in ((0, 3), (3, 8)))
    assert parts == pytest.approx(float(full), rel=1e-12)


def test_penalty_gradient_ignores_garbage_padding():
    lp, _, _, mask = make_batch(43)
    ref = lp.detach() - 0.1
    lp_bad = lp.clone()
    lp_bad[~mask] = float("nan")
    _, _, g = grad_of(lambda x: (ref_kl_penalty(x, ref, mask, 1.0)[0], {}), lp_bad)
    assert torch.isfinite(g).all() and torch.all(g[~mask] == 0)
