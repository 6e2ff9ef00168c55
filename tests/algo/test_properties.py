"""Hypothesis: finite losses and bounded gradients for any finite input; DPCC's bound and no-drop."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpcc_megatron.algo import LossNormalizer, get_policy_loss
from dpcc_megatron.config.algo import DPCCConfig, LossConfig

from . import reference as ref
from .helpers import LOSSES, grad_of

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    floats = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=64)
    lp = draw(st.lists(st.lists(floats, min_size=T, max_size=T), min_size=B, max_size=B))
    old = draw(st.lists(st.lists(floats, min_size=T, max_size=T), min_size=B, max_size=B))
    mask = draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B))
    # Zero or |A| >= 1e-6: subnormal advantages would underflow any gradient to 0.
    adv_f = st.one_of(st.just(0.0), st.floats(1e-6, 100), st.floats(-100, -1e-6))
    per_token = draw(st.booleans())
    adv = draw(st.lists(st.lists(adv_f, min_size=T, max_size=T), min_size=B, max_size=B)) if per_token \
        else draw(st.lists(adv_f, min_size=B, max_size=B))
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return t(lp), t(old), t(adv), torch.tensor(mask, dtype=torch.bool)


def _denominators(name, mask):
    """Per-token aggregation denominator of each loss (what the per-token gradient is divided by)."""
    n = LossNormalizer.from_mask(mask)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1).double().expand(mask.shape)
    agg = get_policy_loss(name).aggregation
    if agg == "token_mean":
        return torch.full(mask.shape, max(n.num_tokens, 1.0), dtype=torch.float64)
    if agg in ("seq_mean_token_mean", "seq_mean"):
        return lengths * max(n.num_seqs, 1.0)
    return torch.full(mask.shape, n.num_rows * n.max_len, dtype=torch.float64)


@SETTINGS
@given(batches(), st.sampled_from(LOSSES))
def test_finite_loss_and_bounded_gradient(batch, name):
    lp, old, adv, mask = batch
    loss, metrics, grad = grad_of(get_policy_loss(name), lp, old, adv, mask)
    assert math.isfinite(float(loss))
    assert torch.isfinite(grad).all()
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert torch.all(grad[~mask] == 0)
    adv_bt = adv if adv.dim() == 2 else adv[:, None].expand_as(lp)
    bound = ref.max_weight(name) * adv_bt.abs() / _denominators(name, mask)
    assert torch.all(grad.abs() <= bound * (1 + 1e-9) + 1e-300)


@SETTINGS
@given(batches(), st.floats(1.0001, 5.0), st.sampled_from(["clip", "decay"]))
def test_dpcc_gradient_is_bounded_by_tau_and_never_zero(batch, tau, truncation):
    lp, old, adv, mask = batch
    cfg = LossConfig(dpcc=DPCCConfig(tau=tau, truncation=truncation))
    _, metrics, grad = grad_of(get_policy_loss("dpcc"), lp, old, adv, mask, cfg)
    adv_bt = adv if adv.dim() == 2 else adv[:, None].expand_as(lp)
    n = max(float(mask.sum()), 1.0)
    scaled = grad.abs() * n  # per-token gradient before the token mean
    assert torch.all(scaled <= tau * adv_bt.abs() * (1 + 1e-12))
    r = torch.exp((lp - old).clamp(-20, 20))
    drifting = torch.where(adv_bt >= 0, r > tau, r < 1 / tau)
    floor = mask if truncation == "clip" else mask & ~drifting  # decay: the drifting side may go lower
    assert torch.all(scaled[floor] >= adv_bt.abs()[floor] / tau * (1 - 1e-12))
    used = mask & (adv_bt != 0) & ((lp - old).abs() < 15)  # beyond, exp(-2 * excess) may underflow float64 products
    assert torch.all(grad[used] != 0)  # no silent drop
    assert float(metrics["utilisation"]) == 1.0


@SETTINGS
@given(batches(), st.sampled_from(LOSSES))
def test_value_matches_reference_on_wild_inputs(batch, name):
    lp, old, adv, mask = batch
    loss, _, grad = grad_of(get_policy_loss(name), lp, old, adv, mask)
    value, ref_grad = ref.reference(name, lp.tolist(), old.tolist(), adv.tolist(), mask.tolist())
    assert math.isclose(float(loss), value, rel_tol=1e-9, abs_tol=1e-9 * (1 + abs(value)))
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=grad.dtype), rtol=1e-9, atol=1e-12)
