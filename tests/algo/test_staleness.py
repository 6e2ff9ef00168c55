"""DPCC reads staleness: the behaviour KL of an off-policy batch spends drift budget (tau_t, LR)."""
from __future__ import annotations

import math

import pytest

from dpcc_megatron.algo import DPCCController, adaptive_threshold
from dpcc_megatron.algo.schedule import staleness_lr_factor
from dpcc_megatron.config import ConfigError, load_config
from dpcc_megatron.config.algo import DPCCConfig


def _ctl(**kw):
    c = DPCCConfig(early_phase_fraction=0.0, early_relax_fraction=0.0, **kw)
    ctl = DPCCController(c, 100)
    ctl.observe(0.004, probe=True)
    return ctl


def test_the_behaviour_kl_tightens_tau_and_scales_the_lr():
    sync, stale = _ctl(), _ctl()
    stale.observe_behaviour(0.01)
    c = stale.config
    assert c.behaviour_kl_weight == 1.0  # the calibrated preset reads staleness
    assert stale.tau_adaptive == adaptive_threshold(c.tau0, c.alpha, stale.kl_ema + 0.01, c.tau_min)
    assert stale.tau < sync.tau
    assert stale.lr_factor == pytest.approx(sync.lr_factor * math.sqrt((0.02 - 0.01) / 0.02))
    assert stale.metrics()["dpcc/behaviour_kl"] == 0.01 and "dpcc/behaviour_kl" not in sync.metrics()
    # a synchronous iteration after it: nothing spent
    stale.observe_behaviour(None)
    assert stale.tau == sync.tau and stale.lr_factor == sync.lr_factor


def test_the_paper_preset_and_a_zero_weight_ignore_staleness():
    for kw in ({"preset": "paper"}, {"behaviour_kl_weight": 0.0}):
        sync, stale = _ctl(**kw), _ctl(**kw)
        stale.observe_behaviour(0.05)
        assert stale.tau == sync.tau and stale.lr_factor == sync.lr_factor


def test_staleness_lr_factor_is_floored_and_neutral_without_spent_drift():
    assert staleness_lr_factor(0.0, 0.02) == 1.0
    assert staleness_lr_factor(0.005, 0.02) == pytest.approx(math.sqrt(0.75))
    assert staleness_lr_factor(1.0, 0.02) == pytest.approx(0.5)  # at most half the LR
    with pytest.raises(ValueError):
        staleness_lr_factor(float("nan"), 0.02)


def test_the_behaviour_kl_is_checkpointed_and_a_nonfinite_one_counted():
    a = _ctl()
    a.observe_behaviour(0.012)
    b = _ctl()
    b.load_state_dict(a.state_dict())
    assert b.behaviour_kl == 0.012 and b.lr_factor == a.lr_factor and b.tau == a.tau
    old = a.state_dict()
    old.pop("behaviour_kl")
    old["version"] = 2
    b.load_state_dict(old)
    assert b.behaviour_kl is None
    before = a.counters["nonfinite_kl"]
    a.observe_behaviour(float("nan"))
    assert a.counters["nonfinite_kl"] == before + 1 and a.behaviour_kl == 0.0


@pytest.mark.parametrize("overrides, key", [
    (["loss.behaviour_is_cap=0.5"], "loss.behaviour_is_cap"),
    (["loss.behaviour_is_cap=2.0", "precision.tis_cap=2.0"], "loss.behaviour_is_cap"),
    (["rollout.max_staleness=-1"], "rollout.max_staleness"),
    (["rollout.max_staleness=1", "loss.name=clip_cov"], "rollout.max_staleness"),
    (["loss.dpcc.behaviour_kl_weight=-1"], "loss.dpcc.behaviour_kl_weight"),
])
def test_new_keys_are_validated(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=overrides)


def test_new_keys_load():
    cfg = load_config(overrides=["rollout.max_staleness=2", "loss.behaviour_is_cap=3.0",
                                 "loss.dpcc.behaviour_kl_weight=0.5"])
    assert (cfg.rollout.max_staleness, cfg.loss.behaviour_is_cap, cfg.loss.dpcc.behaviour_kl_weight) == (2, 3.0, 0.5)
