"""The decoupled (off-policy) objective: behaviour weight between the sampler and the proximal policy,
ratio against the proximal policy; against the plain-Python reference, and exactly the synchronous
loss when there is nothing to correct."""
from __future__ import annotations

import math

import pytest
import torch

from dpcc_megatron.algo import get_policy_loss
from dpcc_megatron.algo.decoupled import (DEFAULT_BEHAVIOUR_CAP, behaviour_kl, behaviour_weights, decoupled_loss,
                                          resolve_behaviour_cap)
from dpcc_megatron.config.algo import LossConfig

from . import reference as ref
from .helpers import grad_of, make_batch

NAMES = ("grpo", "dapo", "dr_grpo", "cispo", "dpcc")


def _stale(seed, spread=0.6):
    lp, prox, adv, mask = make_batch(seed, spread=0.4)
    g = torch.Generator().manual_seed(seed + 100)
    behaviour = prox + torch.randn(prox.shape, generator=g, dtype=prox.dtype) * spread
    return lp, prox, behaviour, adv, mask


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_loss_matches_the_reference(name, seed):
    lp, prox, behaviour, adv, mask = _stale(seed)
    cfg = LossConfig(name=name, dual_clip_c=3.0 if name == "dapo" else None)
    fn = lambda leaf, *a: decoupled_loss(get_policy_loss(name), leaf, prox, behaviour, adv, mask, cfg, 1.5)  # noqa
    loss, metrics, grad = grad_of(fn, lp)
    value, ref_grad = ref.decoupled_reference(name, lp.tolist(), prox.tolist(), behaviour.tolist(), adv.tolist(),
                                              mask.tolist(), 1.5, dual_c=cfg.dual_clip_c)
    assert float(loss) == pytest.approx(value, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=grad.dtype), rtol=1e-9, atol=1e-12)
    # the cap binds on some tokens and not on others, or the test proves little
    w = behaviour_weights(prox, behaviour, mask, 1.5)
    assert 0 < float(metrics["tis_clip_frac"]) < 1 and float(w[mask].min()) < 1.0
    # the weight changed the loss: it is not the plain loss against prox
    plain, _ = get_policy_loss(name)(lp, prox, adv, mask, cfg)
    assert abs(float(plain) - float(loss)) > 1e-6


@pytest.mark.parametrize("name", NAMES + ("gspo",))
def test_without_staleness_it_is_the_synchronous_loss_bit_for_bit(name):
    lp, prox, _, adv, mask = _stale(3)
    cfg = LossConfig(name=name, ref_kl_coef=0.05)
    ref_lp = prox - 0.1
    sync = grad_of(lambda leaf: get_policy_loss(name)(leaf, prox, adv, mask, cfg, ref_logprobs=ref_lp), lp)
    for behaviour, cap in ((None, None), (prox.clone(), 2.0)):  # no weight; pi_b == pi_prox gives w == 1
        fn = lambda leaf: decoupled_loss(get_policy_loss(name), leaf, prox, behaviour, adv, mask, cfg, cap,  # noqa
                                         ref_logprobs=ref_lp)
        got = grad_of(fn, lp)
        assert torch.equal(got[0], sync[0]) and torch.equal(got[2], sync[2])
        for k in sync[1]:
            assert torch.equal(got[1][k], sync[1][k])


def test_behaviour_weights_truncate_and_mask():
    prox = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    beh = torch.tensor([[-1.0, -1.0, -1.5, -9.0]])
    mask = torch.tensor([[True, True, True, False]])
    w = behaviour_weights(prox, beh, mask, 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, math.exp(-0.5), 0.0]]))
    with pytest.raises(ValueError, match="cap"):
        behaviour_weights(prox, beh, mask, 0.5)
    # k3 of KL(pi_b || pi_prox) on the sampled tokens
    lw = torch.tensor([1.0, 0.0, -0.5])
    assert behaviour_kl(prox, beh, mask) == pytest.approx(float((lw.exp() - 1 - lw).mean()))
    assert behaviour_kl(prox, beh, torch.zeros_like(mask)) == 0.0


def test_the_cap_resolves_from_the_config():
    assert resolve_behaviour_cap(None, None, 0) is None
    assert resolve_behaviour_cap(None, None, 1) == DEFAULT_BEHAVIOUR_CAP
    assert resolve_behaviour_cap(None, 1.7, 2) == 1.7
    assert resolve_behaviour_cap(3.0, None, 0) == 3.0
