"""loss section of the config tree: the policy loss, the DPCC controller, KL and advantages.

    loss:
      name: dpcc                 # grpo | dapo | dr_grpo | gspo | cispo | dpcc | clip_cov | kl_cov
      ref_kl_coef: 0.0           # > 0 adds coef * KL(pi_theta || pi_ref) and builds the reference
      ref_model_path: null       # the reference's checkpoint (default: the policy when RL starts)
      ref_offload: false         # reference weights in host memory between uses
      advantage: grpo            # grpo (mean/std in the group) | dr_grpo (mean only)
      dpcc:
        preset: calibrated     # or paper: the method as literally specified
        early_phase_fraction: 0.2
        drift_threshold: 0.02

The formulas behind every field are in ``docs/algorithm.md``. This module
imports nothing but the config machinery, so loading a config never imports torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from .base import check

#: Built-in policy losses of ``dpcc_megatron.algo`` (the registry is checked against this list in tests).
POLICY_LOSSES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "dpcc", "clip_cov", "kl_cov")
KLEstimator = Literal["k1", "k2", "k3"]


#: Values of the preset-dependent DPCC fields. ``paper`` is the method as literally specified;
#: ``calibrated`` (the default) is the version chosen from the stability benchmark's evidence
#: (docs/algorithm.md, "Presets"; benchmarks/stability/RESULTS.md).
DPCC_PRESETS: dict[str, dict] = {
    "paper": {"tau0": 2.0, "alpha": 5.0, "tau_min": 1.1, "early_tau": 1.2, "drift_score": "kl",
              "skip_fresh_kl": False, "truncation": "clip", "early_lr_warmup": False, "drift_probe": False,
              "drift_lr_rule": "step", "behaviour_kl_weight": 0.0},
    # tau0 = 1.28 is DAPO's clip-higher bound. alpha = 18 puts tau_t at tau_min once the smoothed KL
    # reaches the KL target 0.01 nats/token of the drift probe's KL(pi_old || pi_new) per token, k3
    # (1 - 18 * 0.01 = 0.82 = 1.05 / 1.28). Chosen on the development seeds from targets 0.01, 0.02,
    # 0.05 and 0.1 (benchmarks/stability/kl-target-calibration.md); the earlier 0.005 (alpha 36) was
    # stated in per-step units and kept tau at tau_min at the safe LR. The KL-target LR rule (drift
    # target drift_threshold = 0.02 of the probe's KL) without the early LR warm-up was chosen over the
    # step rule and its variants by two pre-registered development rounds
    # (benchmarks/stability/kl-target-rule.md).
    "calibrated": {"tau0": 1.28, "alpha": 18.0, "tau_min": 1.05, "early_tau": 1.1, "drift_score": "kl_ema",
                   "skip_fresh_kl": True, "truncation": "decay", "early_lr_warmup": False, "drift_probe": True,
                   "drift_lr_rule": "kl_target", "behaviour_kl_weight": 1.0},
}


@dataclass
class DPCCConfig:
    """Dynamic policy calibration: adaptive ratio threshold tau_t, early phase and drift-aware LR.

    Fields left null take their value from ``preset`` when the config is built.

    Read by: dpcc_megatron/algo/, dpcc_megatron/train/update.py, dpcc_megatron/train/metrics.py,
    dpcc_megatron/train/trainer.py.
    """

    preset: Literal["calibrated", "paper"] = "calibrated"
    """Where the null fields below take their values (DPCC_PRESETS): `calibrated` (default, chosen from
    the stability benchmark) or `paper` (the method as literally specified, for reproduction)."""
    tau0: Optional[float] = None
    """Largest ratio threshold; tau_t = tau0 * (1 - alpha * D) clamped to [tau_min, tau0] (paper 2.0, calibrated 1.28)."""
    alpha: Optional[float] = None
    """Sensitivity of tau_t to the smoothed KL D; 0 keeps tau_t = tau0 after the early phase (paper 5, calibrated 18)."""
    tau_min: Optional[float] = None
    """Smallest threshold; must be > 1 so the trust region [1/tau, tau] never collapses (paper 1.1, calibrated 1.05)."""
    kl_estimator: KLEstimator = "k3"
    """Estimator (k1, k2 or k3) of the measured KL(pi_old || pi_new) token mean that drives tau_t and the
    drift score, and that the record logs as `kl_old_new`; every step computes all three."""
    kl_ema_decay: float = 0.9
    """EMA smoothing D <- decay * D + (1 - decay) * kl; the first observation initialises D; 0 disables smoothing."""
    total_steps: Optional[int] = None
    """Optimizer steps of the whole run for the early-phase schedule; None: the trainer derives it from `train`."""
    early_phase_fraction: float = 0.2
    """Share of total_steps during which tau_t is capped at early_tau; 0 disables the early phase."""
    early_relax_fraction: float = 0.1
    """Share of total_steps after the early phase over which the cap rises linearly from early_tau to tau0 (0: a step)."""
    early_tau: Optional[float] = None
    """Conservative threshold cap of the early phase, in [tau_min, tau0] (paper 1.2, calibrated 1.1)."""
    early_lr_warmup: Optional[bool] = None
    """Also warm the LR up linearly over the early phase (factor (step + 1) / early steps): the early cap
    cannot act on an iteration's first step, whose ratio is exactly 1 (false in both presets; the calibrated
    preset had it on until its KL-target LR rule replaced it)."""
    tau: Optional[float] = None
    """Internal: the threshold tau_t handed to the `dpcc` loss, set every step by
    DPCCController.loss_config(). Must be left unset in a config (refused): for a fixed threshold set
    tau0 with alpha: 0 and early_phase_fraction: 0."""
    truncation: Optional[Literal["clip", "decay"]] = None
    """Token weight outside [1/tau_t, tau_t]: `clip` truncates it to the boundary on both sides (paper);
    `decay` (calibrated) keeps that on the restoring side and, on the drifting side (A > 0 and r > tau_t, or
    A < 0 and r < 1/tau_t), lets it decay smoothly from the boundary value, never to zero."""
    decay_power: float = 2.0
    """`decay`: drifting-side weight = boundary weight * exp(-decay_power * (|log r| - log tau_t))."""
    drift_lr: bool = True
    """Scale the next step's LR by min(1, 0.5 / (d - theta + 1)) when the drift score d exceeds theta."""
    drift_threshold: float = 0.02
    """theta, in the units of the drift score (KL nats per token); with `drift_lr_rule: kl_target` the KL
    target of the drift probe's reading."""
    drift_lr_rule: Optional[Literal["step", "kl_target"]] = None
    """How the drift sets the LR. `step` (paper): min(1, 0.5 / (d - theta + 1)) for the next step only, back to
    1 as soon as d <= theta. `kl_target`: a scale s that latches and recovers, updated by each drift-probe
    reading d: log s <- clamp(log s - kl_target_gain * log(d / theta), log lr_scale_min, 0), a cut of at
    most 2x and a raise of at most `lr_scale_max_raise` per reading; it acts on every step, the iteration's
    first included (needs drift_probe)."""
    kl_target_gain: float = 0.5
    """`kl_target`: gain of the rule in log space; 0.5 corrects a reading in one go when the drift grows
    as the square of the step size (Adam)."""
    lr_scale_min: float = 0.05
    """`kl_target`: the smallest LR scale the rule may reach."""
    lr_scale_init: float = 0.25
    """`kl_target`: the scale the run starts at, in [lr_scale_min, 1], so that the first step, which no
    reading has bounded yet, is not taken at the full LR. Below 1 it is a warm-up that lasts only as long
    as the drift says: the rule raises it (at most `lr_scale_max_raise` per reading) while the drift is
    low (benchmarks/stability/latched-recovery.md; 1 until 2026-12-06)."""
    lr_scale_max_raise: float = 1.25
    """`kl_target`: the largest factor (> 1) by which one reading may raise the scale; a cut is at most a
    factor of 2 per reading whatever this is, so the scale falls fast and recovers slowly (2, as fast as
    it falls, until 2026-12-06)."""
    drift_score: Optional[Literal["kl", "kl_ema"]] = None
    """d: `kl` is the KL measured after the step just taken (reacts at once, paper); `kl_ema` is the smoothed
    D, which latches and recovers across iterations (calibrated)."""
    drift_hysteresis_steps: int = 0
    """After a trigger, keep the reduced factor for this many further steps unless a new trigger replaces it."""
    skip_fresh_kl: Optional[bool] = None
    """Ignore the KL of each iteration's first mini-batch: pi_old was just recomputed from the current
    weights, so it is ~0 by construction. Off (paper), it resets the drift score and the LR factor
    to 1 right before the iteration's first, unclippable step; on (calibrated), they carry over."""
    behaviour_kl_weight: Optional[float] = None
    """beta: how much of the behaviour KL, KL(pi_b || pi_prox) of an off-policy batch
    (`rollout.max_staleness` >= 1), counts as drift already spent. tau_t is computed from D + beta * kl_b
    instead of D, and the LR is scaled by sqrt(max(theta - beta * kl_b, theta / 4) / theta)
    (docs/algorithm.md, "Off-policy batches"); 0 ignores staleness (paper 0, calibrated 1). Synchronous
    runs (max_staleness 0) pass no behaviour KL, so it has no effect there."""
    drift_probe: Optional[bool] = None
    """After each iteration's optimizer steps, measure KL(pi_old || pi_new) with one forward-only
    micro-batch (PP of them with a virtual pipeline) of the iteration's first mini-batch and feed it to
    the controller, so drift is read even
    with one optimizer step per iteration (paper false, calibrated true)."""

    def __post_init__(self) -> None:
        preset = DPCC_PRESETS.get(self.preset)
        if preset is None:  # the loader refuses an unknown preset with the key named; direct use too
            raise ValueError(f"loss.dpcc.preset must be one of {sorted(DPCC_PRESETS)}, got {self.preset!r}")
        for name, value in preset.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def validate(self) -> None:
        check(self.tau0 > 1, "tau0", f"must be > 1, got {self.tau0}")
        check(self.alpha >= 0, "alpha", f"must be >= 0, got {self.alpha}")
        check(self.tau_min > 1, "tau_min", f"must be > 1, got {self.tau_min}")
        check(self.tau_min <= self.tau0, "tau_min", f"must be <= tau0={self.tau0}, got {self.tau_min}")
        check(0 <= self.kl_ema_decay < 1, "kl_ema_decay", f"must be in [0, 1), got {self.kl_ema_decay}")
        check(self.total_steps is None or self.total_steps >= 1, "total_steps",
              f"must be >= 1 or null, got {self.total_steps}")
        check(0 <= self.early_phase_fraction <= 1, "early_phase_fraction",
              f"must be in [0, 1], got {self.early_phase_fraction}")
        check(0 <= self.early_relax_fraction <= 1, "early_relax_fraction",
              f"must be in [0, 1], got {self.early_relax_fraction}")
        check(self.tau_min <= self.early_tau <= self.tau0, "early_tau",
              f"must be in [tau_min={self.tau_min}, tau0={self.tau0}], got {self.early_tau}")
        check(self.tau is None, "tau",
              f"is set by the DPCC controller every step and cannot be configured (got {self.tau}); "
              "for a fixed threshold set tau0 with alpha: 0, early_phase_fraction: 0 and early_relax_fraction: 0")
        check(self.drift_threshold >= 0, "drift_threshold", f"must be >= 0, got {self.drift_threshold}")
        check(self.decay_power > 0, "decay_power", f"must be > 0, got {self.decay_power}")
        check(self.drift_hysteresis_steps >= 0, "drift_hysteresis_steps",
              f"must be >= 0, got {self.drift_hysteresis_steps}")
        check(self.drift_lr_rule != "kl_target" or self.drift_threshold > 0, "drift_threshold",
              f"is the KL target of drift_lr_rule: kl_target and must be > 0, got {self.drift_threshold}")
        check(self.drift_lr_rule != "kl_target" or self.drift_probe or not self.drift_lr, "drift_lr_rule",
              "kl_target reads the drift probe's KL: set drift_probe: true (or drift_lr: false)")
        check(self.behaviour_kl_weight >= 0 and math.isfinite(self.behaviour_kl_weight), "behaviour_kl_weight",
              f"must be a finite number >= 0, got {self.behaviour_kl_weight}")
        check(self.kl_target_gain > 0, "kl_target_gain", f"must be > 0, got {self.kl_target_gain}")
        check(0 < self.lr_scale_min <= 1, "lr_scale_min", f"must be in (0, 1], got {self.lr_scale_min}")
        check(self.lr_scale_min <= self.lr_scale_init <= 1, "lr_scale_init",
              f"must be in [lr_scale_min={self.lr_scale_min}, 1], got {self.lr_scale_init}")
        check(self.lr_scale_max_raise > 1, "lr_scale_max_raise", f"must be > 1, got {self.lr_scale_max_raise}")
        if self.drift_lr_rule != "kl_target":  # the rule's own keys would be accepted and ignored
            for name in ("kl_target_gain", "lr_scale_min", "lr_scale_init", "lr_scale_max_raise"):
                default = DPCCConfig.__dataclass_fields__[name].default
                check(getattr(self, name) == default, name,
                      f"is read only by drift_lr_rule: kl_target (the rule is {self.drift_lr_rule!r}); "
                      f"got {getattr(self, name)}, leave it at {default}")


@dataclass
class LossConfig:
    """Policy loss (one of the registered losses), reference-KL penalty and group advantages.

    Read by: dpcc_megatron/algo/, dpcc_megatron/train/.
    """

    name: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo", "dpcc", "clip_cov", "kl_cov"] = "dpcc"
    """Registered policy loss."""
    clip_eps: float = 0.2
    """grpo, dr_grpo: symmetric PPO clip, ratio kept in [1 - eps, 1 + eps]."""
    clip_eps_low: float = 0.2
    """dapo: lower clip, ratio >= 1 - eps_low."""
    clip_eps_high: float = 0.28
    """dapo: clip-higher, ratio <= 1 + eps_high."""
    dual_clip_c: Optional[float] = None
    """grpo, dapo, dr_grpo: dual-clip bound c > 1 for A < 0 (loss <= -c * A); None disables it."""
    gspo_eps_low: float = 3e-4
    """gspo: sequence ratio kept >= 1 - eps_low."""
    gspo_eps_high: float = 4e-4
    """gspo: sequence ratio kept <= 1 + eps_high."""
    cispo_eps_high: float = 0.28
    """cispo: importance weight truncated at 1 + eps_high (no lower bound)."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: share of valid tokens (at least one) whose gradient is dropped among the candidates."""
    clip_cov_lb: float = 1.0
    """clip_cov: candidates have covariance above this..."""
    clip_cov_ub: float = 5.0
    """...and below this."""
    kl_cov_ratio: float = 2e-4
    """kl_cov: share of valid tokens (at least one), highest covariance first, that get the |log r| penalty."""
    kl_cov_coef: float = 1.0
    """kl_cov: coefficient of the |log r| penalty."""
    log_ratio_clamp: float = 20.0
    """|log pi_theta - log pi_old| is clamped to this before exp, so no ratio is inf."""
    ref_kl_coef: float = 0.0
    """Coefficient of the reference-policy penalty KL(pi_theta || pi_ref); > 0 builds a frozen reference
    model at the policy's layout, 0 disables both."""
    ref_model_path: Optional[str] = None
    """Megatron checkpoint (converted or trained) or NeMo 2 checkpoint of the reference policy; None: the
    policy's weights when RL starts (after checkpoint.load and the warm-start). Needs ref_kl_coef > 0."""
    ref_offload: bool = False
    """Keep the reference weights in host memory between uses; they visit the GPU only for its forward.
    Needs ref_kl_coef > 0."""
    kl_estimator: KLEstimator = "k3"
    """Estimator of the reference-policy penalty's value (logged as `ref_kl`); its gradient is the on-policy
    gradient of KL(pi_theta || pi_ref) whatever the estimator (docs/algorithm.md)."""
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    """Group-relative advantage: `grpo` (r - mean) / (std + eps), `dr_grpo` r - mean."""
    advantage_eps: float = 1e-6
    """eps of the GRPO std normalisation."""
    advantage_per_component: bool = False
    """Multi-part rewards: normalise each reward component within its group before the weighted sum."""
    behaviour_is_cap: Optional[float] = None
    """C of the decoupled objective's truncated importance weight sg(min(pi_prox / pi_b, C)) between the
    behaviour policy that sampled (the engine's log-probs, up to rollout.max_staleness versions old) and the
    proximal policy the ratio is taken against (the trainer's weights at the start of the update);
    docs/algorithm.md, "Off-policy batches". null: precision.tis_cap if set (the same weight under its
    synchronous name; setting both is refused), else 2.0 when rollout.max_staleness >= 1, else no weight."""
    dpcc: DPCCConfig = field(default_factory=DPCCConfig)
    """DPCC threshold schedule and drift-aware LR."""

    def validate(self) -> None:
        check(0 < self.clip_eps < 1, "clip_eps", f"must be in (0, 1), got {self.clip_eps}")
        check(0 < self.clip_eps_low < 1, "clip_eps_low", f"must be in (0, 1), got {self.clip_eps_low}")
        check(self.clip_eps_high > 0, "clip_eps_high", f"must be > 0, got {self.clip_eps_high}")
        check(self.dual_clip_c is None or self.dual_clip_c > 1, "dual_clip_c",
              f"must be > 1 or null, got {self.dual_clip_c}")
        check(0 < self.gspo_eps_low < 1, "gspo_eps_low", f"must be in (0, 1), got {self.gspo_eps_low}")
        check(self.gspo_eps_high > 0, "gspo_eps_high", f"must be > 0, got {self.gspo_eps_high}")
        check(self.cispo_eps_high > 0, "cispo_eps_high", f"must be > 0, got {self.cispo_eps_high}")
        check(0 < self.clip_cov_ratio <= 1, "clip_cov_ratio", f"must be in (0, 1], got {self.clip_cov_ratio}")
        check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_ub",
              f"must be > clip_cov_lb={self.clip_cov_lb}, got {self.clip_cov_ub}")
        check(0 < self.kl_cov_ratio <= 1, "kl_cov_ratio", f"must be in (0, 1], got {self.kl_cov_ratio}")
        check(self.kl_cov_coef >= 0, "kl_cov_coef", f"must be >= 0, got {self.kl_cov_coef}")
        check(0 < self.log_ratio_clamp <= 80, "log_ratio_clamp", f"must be in (0, 80], got {self.log_ratio_clamp}")
        check(self.ref_kl_coef >= 0, "ref_kl_coef", f"must be >= 0, got {self.ref_kl_coef}")
        check(self.ref_model_path is None or self.ref_kl_coef > 0, "ref_model_path",
              "is set but ref_kl_coef is 0, so no reference model would be built")
        check(not self.ref_offload or self.ref_kl_coef > 0, "ref_offload",
              "is set but ref_kl_coef is 0, so no reference model would be built")
        check(self.advantage_eps > 0, "advantage_eps", f"must be > 0, got {self.advantage_eps}")
        check(self.behaviour_is_cap is None or (math.isfinite(self.behaviour_is_cap) and self.behaviour_is_cap >= 1.0),
              "behaviour_is_cap", f"must be a finite number >= 1 (or null), got {self.behaviour_is_cap}")
