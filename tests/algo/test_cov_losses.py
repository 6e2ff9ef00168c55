"""clip_cov and kl_cov against the plain-Python reference, and their token selection."""
from __future__ import annotations

import pytest
import torch

from dpcc_megatron.algo import get_policy_loss
from dpcc_megatron.config.algo import LossConfig

from . import reference as ref
from .helpers import grad_of, make_batch


def _check(name, cfg, expected, seed):
    lp, old, adv, mask = make_batch(seed, B=8, T=12, spread=0.5)
    value, metrics, grad = grad_of(get_policy_loss(name), lp, old, adv, mask, cfg)
    want_value, want_grad = expected(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist())
    assert float(value) == pytest.approx(want_value, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=grad.dtype), rtol=1e-9, atol=1e-12)
    return metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_matches_the_reference(seed):
    # lb/ub chosen so some tokens are candidates; ratio 1: every candidate is dropped (no draw)
    cfg = LossConfig(clip_eps=0.2, clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=3.0)
    metrics = _check("clip_cov", cfg, lambda *a: ref.clip_cov_reference(*a, 0.2, 0.05, 3.0), seed)
    assert float(metrics["cov_frac"]) > 0  # the case really drops tokens


@pytest.mark.parametrize("seed,ratio", [(0, 0.1), (1, 0.3), (2, 1e-4)])
def test_kl_cov_matches_the_reference(seed, ratio):
    cfg = LossConfig(kl_cov_ratio=ratio, kl_cov_coef=0.7)
    metrics = _check("kl_cov", cfg, lambda *a: ref.kl_cov_reference(*a, ratio, 0.7), seed)
    assert float(metrics["cov_frac"]) > 0


def test_clip_cov_drops_exactly_its_share_and_the_same_tokens_every_time():
    lp, old, adv, mask = make_batch(7, B=16, T=32, spread=0.5)
    cfg = LossConfig(clip_cov_ratio=0.02, clip_cov_lb=0.0, clip_cov_ub=10.0)
    k = max(int(0.02 * int(mask.sum())), 1)
    runs = [grad_of(get_policy_loss("clip_cov"), lp, old, adv, mask, cfg) for _ in range(2)]
    (_, m1, g1), (_, m2, g2) = runs
    assert float(m1["cov_frac"]) * float(mask.sum()) == pytest.approx(k)
    assert torch.equal(g1, g2)  # deterministic draw
    _, _, plain = grad_of(get_policy_loss("grpo"), lp, old, adv, mask, LossConfig())
    silenced = ((g1 == 0) & (plain != 0) & mask).sum()
    assert int(silenced) == k


def test_cov_keys_are_validated():
    from dpcc_megatron.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="loss.clip_cov_ub must be > clip_cov_lb"):
        load_config(overrides=["loss.clip_cov_lb=5", "loss.clip_cov_ub=1"])
    with pytest.raises(ConfigError, match="loss.kl_cov_ratio must be in"):
        load_config(overrides=["loss.kl_cov_ratio=0"])
    with pytest.raises(ConfigError, match="precision.tis_cap cannot be combined with loss.name='kl_cov'"):
        load_config(overrides=["loss.name=kl_cov", "precision.tis_cap=2.0"])
