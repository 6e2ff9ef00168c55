"""DPCC's formulas at exact values, the early-phase schedule and the controller's state."""
from __future__ import annotations

import json
import math
import random

import pytest

from dpcc_megatron.algo import DPCCController, adaptive_threshold, drift_lr_factor, early_phase_cap
from dpcc_megatron.config.algo import DPCCConfig, LossConfig


@pytest.mark.parametrize("tau0,alpha,kl,tau_min,expected", [
    (2.0, 5.0, 0.02, 1.1, 1.8),        # 2 * (1 - 0.1)
    (2.0, 5.0, 0.0, 1.1, 2.0),
    (2.0, 5.0, 0.5, 1.1, 1.1),         # 2 * (1 - 2.5) < tau_min: clamped up
    (2.0, 5.0, 0.09, 1.1, 1.1),        # 2 * 0.55 = 1.1 exactly at the floor
    (2.0, 5.0, -0.1, 1.1, 2.0),        # a negative k1 estimate cannot loosen beyond tau0
    (3.0, 2.0, 0.1, 1.5, 2.4),
    (2.0, 0.0, 7.0, 1.1, 2.0),         # alpha = 0: fixed tau0
    (2.0, 0.0, math.inf, 1.1, 2.0),
    (2.0, 5.0, math.inf, 1.1, 1.1),
])
def test_adaptive_threshold_exact(tau0, alpha, kl, tau_min, expected):
    assert adaptive_threshold(tau0, alpha, kl, tau_min) == pytest.approx(expected, abs=1e-12)


def test_adaptive_threshold_refuses_nan_and_inverted_bounds():
    with pytest.raises(ValueError, match="NaN"):
        adaptive_threshold(2.0, 5.0, math.nan, 1.1)
    with pytest.raises(ValueError, match="tau_min"):
        adaptive_threshold(2.0, 5.0, 0.0, 2.5)


@pytest.mark.parametrize("drift,threshold,expected", [
    (0.01, 0.02, 1.0),
    (0.02, 0.02, 1.0),                 # not above the threshold
    (0.03, 0.02, 0.5 / 1.01),
    (0.52, 0.02, 0.5 / 1.5),
    (3.0, 1.0, 0.5 / 3.0),
    (-1.0, 0.0, 1.0),
])
def test_drift_lr_factor_exact(drift, threshold, expected):
    assert drift_lr_factor(drift, threshold) == pytest.approx(expected, abs=1e-12)


def test_early_phase_cap_schedule():
    # total 20, early 20% -> steps 0..3 capped at 1.2; relax 20% -> +0.2 per step over steps 4..7.
    caps = [early_phase_cap(s, 20, 2.0, 1.2, 0.2, 0.2) for s in range(10)]
    assert caps == pytest.approx([1.2, 1.2, 1.2, 1.2, 1.2, 1.4, 1.6, 1.8, 2.0, 2.0])
    # No relaxation window: a step at the end of the early phase.
    assert [early_phase_cap(s, 10, 2.0, 1.3, 0.2, 0.0) for s in range(4)] == [1.3, 1.3, 2.0, 2.0]
    # Early phase off.
    assert early_phase_cap(0, 10, 2.0, 1.3, 0.0, 0.0) == 2.0


def _cfg(**kw):
    base = dict(preset="paper", tau0=2.0, alpha=5.0, tau_min=1.1, kl_ema_decay=0.5, total_steps=20, early_phase_fraction=0.2,
                early_relax_fraction=0.2, early_tau=1.2, drift_threshold=0.05)
    base.update(kw)
    return DPCCConfig(**base)


def test_controller_exact_sequence():
    ctl = DPCCController(_cfg())
    assert ctl.tau == 1.2 and ctl.lr_factor == 1.0 and ctl.step == 0
    ctl.observe(0.04)                      # D = 0.04 -> adaptive 1.6, capped at 1.2
    assert (ctl.step, ctl.kl_ema, ctl.tau_adaptive, ctl.tau, ctl.lr_factor) == pytest.approx((1, 0.04, 1.6, 1.2, 1.0))
    ctl.observe(0.10)                      # D = 0.07 -> 1.3; drift 0.10 > 0.05
    assert ctl.kl_ema == pytest.approx(0.07) and ctl.tau_adaptive == pytest.approx(1.3)
    assert ctl.tau == pytest.approx(1.2)
    assert ctl.lr_factor == pytest.approx(0.5 / 1.05)
    ctl.observe(0.0)                       # D = 0.035 -> 1.65; the factor is back to exactly 1
    assert ctl.lr_factor == 1.0 and ctl.tau_adaptive == pytest.approx(1.65)
    ctl.observe(0.0)                       # step 4: D = 0.0175 -> 1.825, cap 1.2
    assert ctl.tau == pytest.approx(1.2)
    ctl.observe(0.0)                       # step 5: D = 0.00875 -> 1.9125, cap 1.4
    assert ctl.step == 5 and ctl.tau == pytest.approx(1.4)
    for _ in range(3):
        ctl.observe(0.0)                   # step 8: cap lifted, tau is the adaptive value
    assert ctl.tau_cap == 2.0 and ctl.tau == pytest.approx(2.0 * (1 - 5.0 * 0.07 * 0.5 ** 6))
    assert ctl.counters["drift_triggers"] == 1 and ctl.counters["lr_reduced_steps"] == 1


def test_controller_tau_floor_and_loss_config():
    ctl = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0))
    ctl.observe(1.0)
    assert ctl.tau == 1.1 and ctl.counters["tau_floor_steps"] == 1
    base = LossConfig(clip_eps=0.1)
    cfg = ctl.loss_config(base)
    assert cfg.dpcc.tau == 1.1 and cfg.clip_eps == 0.1 and base.dpcc.tau is None


def test_alpha_zero_without_early_phase_is_fixed_tau0():
    ctl = DPCCController(_cfg(alpha=0.0, early_phase_fraction=0.0, early_relax_fraction=0.0, total_steps=None))
    for kl in (0.0, 0.5, 10.0, 0.01):
        ctl.observe(kl)
        assert ctl.tau == 2.0


def test_lr_factor_never_compounds():
    ctl = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0))
    ctl.observe(0.55)
    assert ctl.lr_factor == pytest.approx(0.5 / 1.5)
    ctl.observe(0.55)                      # a second trigger: the same factor, not its square
    assert ctl.lr_factor == pytest.approx(0.5 / 1.5)
    ctl.observe(0.15)
    assert ctl.lr_factor == pytest.approx(0.5 / 1.1)
    ctl.observe(0.0)
    assert ctl.lr_factor == 1.0


def test_hysteresis_holds_the_reduced_factor():
    ctl = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0, drift_hysteresis_steps=2))
    factors = []
    for kl in (0.55, 0.0, 0.0, 0.0, 0.0):
        ctl.observe(kl)
        factors.append(ctl.lr_factor)
    f = 0.5 / 1.5
    assert factors == pytest.approx([f, f, f, 1.0, 1.0])


def test_drift_score_kl_ema_and_disabled_lr():
    ctl = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0, drift_score="kl_ema"))
    ctl.observe(0.0)
    ctl.observe(0.08)                      # raw 0.08 > 0.05 but D = 0.04 is not
    assert ctl.drift == pytest.approx(0.04) and ctl.lr_factor == 1.0
    ctl.observe(0.1)                       # D = 0.07
    assert ctl.lr_factor == pytest.approx(0.5 / 1.02)
    off = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0, drift_lr=False))
    off.observe(5.0)
    assert off.lr_factor == 1.0 and off.counters["drift_triggers"] == 1


def test_nonfinite_kl_is_counted_and_ignored():
    ctl = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0))
    ctl.observe(0.02)
    before = (ctl.kl_ema, ctl.tau, ctl.lr_factor)
    ctl.observe(float("nan"))
    ctl.observe(float("inf"))
    assert (ctl.kl_ema, ctl.tau, ctl.lr_factor) == before
    assert ctl.step == 3 and ctl.counters["nonfinite_kl"] == 2 and ctl.counters["observations"] == 1


def test_measure_then_advance_only_on_applied_steps():
    """A skipped optimizer step is measured but not counted: the early-phase schedule counts
    applied steps, like the LR scheduler."""
    ctl = DPCCController(_cfg(total_steps=10, early_phase_fraction=0.2, early_relax_fraction=0.0))
    ctl.observe(0.001, advance=False)
    assert ctl.step == 0 and ctl.counters["observations"] == 1
    ctl.observe(float("nan"), advance=False)  # unusable measurement of a skipped step
    assert ctl.step == 0 and ctl.counters["nonfinite_kl"] == 1
    ctl.advance()
    ctl.advance()
    assert ctl.step == 2 and ctl.tau_cap == ctl.config.tau0  # early phase (2 of 10 steps) is over


def test_total_steps_required_for_early_phase():
    with pytest.raises(ValueError, match="total_steps"):
        DPCCController(_cfg(total_steps=None))
    assert DPCCController(_cfg(total_steps=None), total_steps=50).total_steps == 50
    assert DPCCController(_cfg(total_steps=30), total_steps=50).total_steps == 30


def test_state_dict_round_trip_gives_identical_decisions():
    rng = random.Random(0)
    kls = [abs(rng.gauss(0.03, 0.04)) for _ in range(40)]
    cfg = _cfg(total_steps=40, drift_hysteresis_steps=1)
    a = DPCCController(cfg)
    for kl in kls[:13]:
        a.observe(kl)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    b = DPCCController(cfg)
    assert b.tau != a.tau or b.step != a.step
    b.load_state_dict(state)
    for kl in kls[13:]:
        assert (b.tau, b.lr_factor) == (a.tau, a.lr_factor)
        a.observe(kl)
        b.observe(kl)
    assert a.state_dict() == b.state_dict()
    assert a.metrics() == b.metrics()
    assert {"dpcc/tau", "dpcc/lr_factor", "dpcc/kl_ema", "dpcc/drift_triggers"} <= set(a.metrics())


def test_load_state_dict_refuses_foreign_state():
    ctl = DPCCController(_cfg())
    with pytest.raises(ValueError, match="version"):
        ctl.load_state_dict({"version": 99})
    state = ctl.state_dict()
    del state["hold"]
    with pytest.raises(ValueError, match="hold"):
        ctl.load_state_dict(state)


def test_skip_fresh_kl_carries_the_factor_over_the_iteration_boundary():
    # Iteration of 2 mini-batches: the first one's KL is ~0 because pi_old was just recomputed.
    kls = [(0.0, True), (0.55, False), (0.0, True), (0.30, False)]
    as_specified = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0))
    carried = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0, skip_fresh_kl=True))
    seen = {"spec": [], "carried": []}
    for kl, fresh in kls:
        seen["spec"].append(as_specified.lr_factor)
        seen["carried"].append(carried.lr_factor)
        as_specified.observe(kl, fresh=fresh)
        carried.observe(kl, fresh=fresh)
    f = 0.5 / 1.5
    # Factor used by each step: as specified the second iteration's first step is back at 1.
    assert seen["spec"] == pytest.approx([1.0, 1.0, f, 1.0])
    assert seen["carried"] == pytest.approx([1.0, 1.0, f, f])
    assert carried.step == 4 and carried.counters["fresh_kl_skipped"] == 2
    assert carried.counters["observations"] == 2
    assert carried.kl_ema == pytest.approx(0.5 * 0.55 + 0.5 * 0.30)  # decay 0.5; the zeros never entered it
    assert as_specified.counters["fresh_kl_skipped"] == 0
    # a carried reduced factor is a reduced step like any other
    assert (as_specified.counters["lr_reduced_steps"], carried.counters["lr_reduced_steps"]) == (2, 3)


def test_fresh_kl_counts_as_observation_when_not_skipped():
    ctl = DPCCController(_cfg(early_phase_fraction=0.0, early_relax_fraction=0.0))
    ctl.observe(0.55)
    ctl.observe(0.0, fresh=True)
    assert ctl.lr_factor == 1.0 and ctl.kl_ema == pytest.approx(0.5 * 0.55)


def test_early_lr_warmup_ramps_over_the_early_phase_then_stops():
    from dpcc_megatron.algo.schedule import early_lr_warmup_factor

    ctl = DPCCController(_cfg(early_lr_warmup=True, drift_lr=False))  # 20 steps, early phase 0.2 -> 4 steps
    factors = []
    for _ in range(6):
        factors.append(ctl.lr_factor)
        ctl.observe(0.0)
    assert factors == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert early_lr_warmup_factor(0, 10, 0.0) == 1.0  # no early phase, no warm-up
    off = DPCCController(_cfg(early_lr_warmup=False, drift_lr=False))
    assert off.lr_factor == 1.0 and off.counters["lr_reduced_steps"] == 0


def test_warmup_multiplies_the_drift_factor_and_is_not_counted_as_a_drift_cut():
    ctl = DPCCController(_cfg(early_lr_warmup=True, drift_score="kl"))
    ctl.observe(0.55)  # drift 0.55 > 0.05: factor 0.5 / (0.55 - 0.05 + 1) = 1/3; step 1 -> warm-up 2/4
    assert ctl.lr_factor == pytest.approx(0.5 / 1.5 * 0.5)
    calm = DPCCController(_cfg(early_lr_warmup=True))
    calm.observe(0.0)
    assert calm.counters["lr_reduced_steps"] == 0  # the warm-up alone is no drift cut


def test_calibrated_alpha_moves_tau_at_the_kl_target():
    """The calibrated preset's tau reaches tau_min at the stated KL target (0.01 nats/token of the drift
    probe's KL), moves at the probe KLs of the safe LR (~4e-3) without reaching tau_min there."""
    from dpcc_megatron.algo.schedule import adaptive_threshold
    from dpcc_megatron.config.algo import DPCC_PRESETS

    p = DPCC_PRESETS["calibrated"]
    assert adaptive_threshold(p["tau0"], p["alpha"], 0.01, p["tau_min"]) == pytest.approx(p["tau_min"], rel=1e-3)
    assert adaptive_threshold(p["tau0"], p["alpha"], 0.009, p["tau_min"]) > p["tau_min"]  # not before the target
    assert p["tau_min"] < adaptive_threshold(p["tau0"], p["alpha"], 0.004, p["tau_min"]) < 0.95 * p["tau0"]
    q = DPCC_PRESETS["paper"]
    assert adaptive_threshold(q["tau0"], q["alpha"], 0.001, q["tau_min"]) > 0.99 * q["tau0"]  # the paper's barely moves


@pytest.mark.parametrize("scale,kl,expected", [
    (1.0, 0.08, 0.5),                  # 4x the target 0.02: gain 0.5 halves the scale (one-shot correction)
    (1.0, 0.02, 1.0),                  # at the target: unchanged
    (0.5, 0.005, 1.0),                 # a quarter of the target: doubled, never above 1
    (0.25, 0.005, 0.5),
    (1.0, 2.0, 0.5),                   # 100x the target: limited to a factor of 2 per reading
    (0.06, 2.0, 0.05),                 # never below scale_min
    (0.25, 0.0, 0.5),                  # no drift: the largest recovery step
    (0.25, -0.01, 0.5),                # a negative k1 estimate reads as no drift
    (0.5, math.inf, 0.25),
])
def test_kl_target_scale_exact(scale, kl, expected):
    from dpcc_megatron.algo import kl_target_scale

    assert kl_target_scale(scale, kl, 0.02, 0.5, 0.05, 2.0) == pytest.approx(expected, abs=1e-12)


def test_kl_target_scale_raises_by_at_most_max_raise_and_cuts_by_at_most_two():
    from dpcc_megatron.algo import kl_target_scale

    # a reading 100x below the target asks for x10: limited to max_raise
    assert kl_target_scale(0.25, 0.0002, 0.02, 0.5, 0.05, max_raise=2.0) == pytest.approx(0.5)
    assert kl_target_scale(0.25, 0.0002, 0.02, 0.5, 0.05, max_raise=1.25) == pytest.approx(0.3125)
    assert kl_target_scale(0.25, 0.0, 0.02, 0.5, 0.05, max_raise=1.25) == pytest.approx(0.3125)
    # a small raise inside the limit is the rule's own correction
    assert kl_target_scale(0.5, 0.02 / 1.21, 0.02, 0.5, 0.05, max_raise=1.25) == pytest.approx(0.55)
    # cuts are not affected by max_raise
    assert kl_target_scale(1.0, 0.32, 0.02, 0.5, 0.05, max_raise=1.25) == pytest.approx(0.5)
    assert kl_target_scale(1.0, 0.08, 0.02, 0.5, 0.05, max_raise=1.25) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="max_raise"):
        kl_target_scale(0.5, 0.01, 0.02, 0.5, 0.05, max_raise=1.0)


def test_slow_recovery_reaches_the_controller():
    slow = DPCCController(_kl_target_cfg(lr_scale_init=0.25, lr_scale_max_raise=1.25))
    fast = DPCCController(_kl_target_cfg(lr_scale_init=0.25))
    for ctl in (slow, fast):
        ctl.observe(0.001, probe=True, advance=False)
    assert (slow.lr_factor, fast.lr_factor) == (pytest.approx(0.3125), pytest.approx(0.5))


def test_kl_target_scale_refuses_bad_arguments():
    from dpcc_megatron.algo import kl_target_scale

    with pytest.raises(ValueError, match="NaN"):
        kl_target_scale(1.0, math.nan, 0.02, 0.5, 0.05, 2.0)
    with pytest.raises(ValueError, match="scale"):
        kl_target_scale(0.01, 0.02, 0.02, 0.5, 0.05, 2.0)
    with pytest.raises(ValueError, match="target"):
        kl_target_scale(1.0, 0.02, 0.0, 0.5, 0.05, 2.0)


def _kl_target_cfg(**kw):
    # The rule's mechanics with the scale starting at 1 and recovering as fast as it falls (the shipped
    # start and recovery: test_the_shipped_rule_starts_low_and_recovers_slower_than_it_falls).
    kw.setdefault("lr_scale_init", 1.0)
    kw.setdefault("lr_scale_max_raise", 2.0)
    return _cfg(drift_lr_rule="kl_target", drift_probe=True, drift_threshold=0.02, early_phase_fraction=0.0,
                early_relax_fraction=0.0, skip_fresh_kl=True, **kw)


def test_kl_target_rule_latches_on_probe_readings_and_recovers():
    ctl = DPCCController(_kl_target_cfg())
    # an iteration of two steps: the fresh reading is skipped, the in-step one moves D (tau) but not the scale
    ctl.observe(0.0, fresh=True)
    ctl.observe(0.5)
    assert ctl.lr_factor == 1.0 and ctl.kl_ema == pytest.approx(0.5)
    ctl.observe(0.08, probe=True, advance=False)  # the probe: 4x the target halves the scale
    assert ctl.lr_scale == pytest.approx(0.5) and ctl.lr_factor == pytest.approx(0.5)
    # the scale carries over the iteration boundary and acts on the next iteration's first step too
    ctl.observe(0.0, fresh=True)
    assert ctl.lr_factor == pytest.approx(0.5)
    ctl.observe(0.0)
    assert ctl.lr_factor == pytest.approx(0.5)  # an in-step zero does not reset it (the step rule would)
    ctl.observe(0.02, probe=True, advance=False)  # at the target: held
    assert ctl.lr_scale == pytest.approx(0.5)
    ctl.observe(0.005, probe=True, advance=False)  # below it: recovers, never above 1
    ctl.observe(0.005, probe=True, advance=False)
    assert ctl.lr_scale == 1.0
    assert ctl.counters["drift_triggers"] == 1  # one probe reading above the target
    assert ctl.counters["lr_reduced_steps"] == 2  # the two steps taken at scale 0.5
    assert ctl.metrics()["dpcc/lr_scale"] == 1.0


def test_kl_target_scale_multiplies_the_warmup_and_survives_a_checkpoint():
    cfg = _cfg(drift_lr_rule="kl_target", drift_probe=True, drift_threshold=0.02, early_lr_warmup=True,
               skip_fresh_kl=True, lr_scale_init=1.0)  # 20 steps, early phase 4 steps
    a = DPCCController(cfg)
    a.observe(0.0, fresh=True)
    a.observe(0.32, probe=True, advance=False)  # 16x the target: the scale falls by 4 -> limited to 2
    assert a.lr_factor == pytest.approx(0.5 * 0.5)  # scale x warm-up (2/4)
    state = json.loads(json.dumps(a.state_dict()))
    b = DPCCController(cfg)
    b.load_state_dict(state)
    assert (b.lr_scale, b.lr_factor) == (a.lr_scale, a.lr_factor)
    # a checkpoint written before the scale existed (version 1) resumes at scale 1
    old = {k: v for k, v in state.items() if k != "lr_scale"}
    old["version"] = 1
    c = DPCCController(cfg)
    c.load_state_dict(old)
    assert c.lr_scale == 1.0 and c.step == a.step


def test_the_shipped_rule_starts_low_and_recovers_slower_than_it_falls():
    from dpcc_megatron.config.algo import DPCCConfig

    cfg = DPCCConfig()  # the calibrated preset with its defaults
    assert (cfg.drift_lr_rule, cfg.lr_scale_init, cfg.lr_scale_max_raise) == ("kl_target", 0.25, 1.25)
    ctl = DPCCController(cfg, total_steps=40)
    assert ctl.lr_factor == 0.25  # the first step, which no reading has bounded yet
    ctl.observe(0.0, fresh=True)
    ctl.observe(0.0002, probe=True, advance=False)  # far below the target: up by 1.25 only
    assert ctl.lr_factor == pytest.approx(0.3125)
    ctl.observe(0.32, probe=True, advance=False)  # far above it: down by 2
    assert ctl.lr_factor == pytest.approx(0.15625)


def test_kl_target_rule_is_off_with_drift_lr_off():
    off = DPCCController(_kl_target_cfg(drift_lr=False))
    off.observe(1.0, probe=True)
    assert off.lr_factor == 1.0 and off.counters["lr_reduced_steps"] == 0


def test_kl_target_scale_can_start_low_and_rises_while_the_drift_is_low():
    ctl = DPCCController(_kl_target_cfg(lr_scale_init=0.25))
    assert ctl.lr_factor == 0.25
    ctl.observe(0.001, probe=True, advance=False)  # far below the target: at most 2x per reading
    assert ctl.lr_scale == pytest.approx(0.5)
    ctl.observe(0.32, probe=True, advance=False)  # far above it: at most 2x down
    assert ctl.lr_scale == pytest.approx(0.25)
