"""DPCCController: the per-run state behind tau_t and the drift-aware LR factor.

Protocol, once per optimizer step:

    ctl = DPCCController(cfg.loss.dpcc, total_steps)
    for each optimizer step:
        loss_cfg = ctl.loss_config(cfg.loss)          # carries tau_t for the dpcc loss
        lr = scheduled_lr * ctl.lr_factor             # this step only; the schedule is untouched
        ... forward/backward/optimizer step with loss_cfg and lr ...
        ctl.observe(kl)   # KL(pi_old || pi_new) measured on the batch just used, after the step

``observe`` advances the step and fixes tau and the LR factor of the NEXT step. The drift probe's
reading after an iteration's steps is passed with ``probe=True``: with ``drift_lr_rule: kl_target``
it is the one reading that moves the latched LR scale.

A trainer that can skip a step (non-finite gradients, fp16 overflow) measures first and
advances only when the optimizer actually applied the step, like Megatron's LR scheduler,
so the early-phase schedule and the LR schedule count the same steps:

        ctl.observe(kl, advance=False)                 # before optimizer.step(): sets the factor
        if step_applied: ctl.advance()
An off-policy batch (``rollout.max_staleness`` >= 1) was sampled by a behaviour policy pi_b some
versions behind the proximal policy pi_prox the update starts from. Before the iteration's steps the
trainer passes its measured KL(pi_b || pi_prox):

        ctl.observe_behaviour(kl_b)                     # once per iteration, before its steps

and with ``behaviour_kl_weight`` beta > 0 that spent drift counts against the trust region (tau_t from
D + beta * kl_b) and the LR (:func:`~.schedule.staleness_lr_factor`). A synchronous trainer never
calls it, and the controller then behaves exactly as without it.

``state_dict()`` is plain JSON-able Python, so a resumed run decides identically.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from dpcc_megatron.config.algo import DPCCConfig, LossConfig

from .schedule import (adaptive_threshold, drift_lr_factor, early_lr_warmup_factor, early_phase_cap, kl_target_scale,
                       staleness_lr_factor)

_STATE_VERSION = 3
#: Versions ``load_state_dict`` reads: 1 predates the KL-target LR scale (read as 1.0, its start), 2 the
#: behaviour KL (read as None: no off-policy batch seen).
_READABLE_VERSIONS = (1, 2, 3)
_COUNTERS = ("observations", "nonfinite_kl", "fresh_kl_skipped", "drift_triggers", "lr_reduced_steps",
             "tau_floor_steps")


class DPCCController:
    """Smoothed KL -> tau_t (with the early-phase cap) and drift score -> LR factor."""

    def __init__(self, config: DPCCConfig, total_steps: Optional[int] = None):
        """``config.total_steps`` wins over ``total_steps`` when set; one is needed for an early phase."""
        self.config = config
        self.total_steps = config.total_steps if config.total_steps is not None else total_steps
        has_early = config.early_phase_fraction > 0 or config.early_relax_fraction > 0
        if has_early and (self.total_steps is None or self.total_steps < 1):
            raise ValueError("DPCCController needs total_steps >= 1 for the early phase "
                             "(set loss.dpcc.total_steps or pass total_steps)")
        self.step = 0
        """Optimizer steps observed so far = index of the next step."""
        self.kl_ema: Optional[float] = None
        self.last_kl: Optional[float] = None
        self.drift: Optional[float] = None
        self._lr_factor = 1.0
        self._hold = 0
        self.lr_scale = config.lr_scale_init if config.drift_lr_rule == "kl_target" else 1.0
        """The KL-target rule's latched LR scale (``drift_lr_rule: kl_target``); 1 otherwise."""
        self.behaviour_kl: Optional[float] = None
        """KL(pi_b || pi_prox) of the current iteration's batch (:meth:`observe_behaviour`); None when synchronous."""
        self.counters = {name: 0 for name in _COUNTERS}

    # -- decisions for the next step ------------------------------------------------
    @property
    def tau_adaptive(self) -> float:
        """tau0 * (1 - alpha * D) clamped to [tau_min, tau0]; D = 0 before any observation."""
        c = self.config
        return adaptive_threshold(c.tau0, c.alpha, (self.kl_ema if self.kl_ema is not None else 0.0)
                                  + self._spent_by_staleness, c.tau_min)

    @property
    def _spent_by_staleness(self) -> float:
        """beta * kl_b: the drift an off-policy batch spent before the update (0 when synchronous).
        A negative estimate (k3 is >= 0; a k1 caller's may not be) spends nothing."""
        if self.behaviour_kl is None or not self.config.behaviour_kl_weight:
            return 0.0
        return self.config.behaviour_kl_weight * max(self.behaviour_kl, 0.0)

    @property
    def tau_cap(self) -> float:
        """Early-phase cap of the next step (tau0 when the early phase is over or off)."""
        c = self.config
        if self.total_steps is None:
            return c.tau0
        return early_phase_cap(self.step, self.total_steps, c.tau0, c.early_tau,
                               c.early_phase_fraction, c.early_relax_fraction)

    @property
    def tau(self) -> float:
        """tau_t of the next step: min(adaptive threshold, early-phase cap)."""
        return min(self.tau_adaptive, self.tau_cap)

    @property
    def warmup_factor(self) -> float:
        """Early-phase LR warm-up of the next step: (step + 1) / E over the E early-phase steps
        (``early_lr_warmup``), else 1."""
        c = self.config
        if not c.early_lr_warmup or self.total_steps is None:
            return 1.0
        return early_lr_warmup_factor(self.step, self.total_steps, c.early_phase_fraction)

    @property
    def drift_factor(self) -> float:
        """The drift-aware part of the next step's LR multiplier: the step rule's factor or the
        KL-target rule's latched scale; 1 when drift-aware LR is off."""
        if not self.config.drift_lr:
            return 1.0
        return self.lr_scale if self.config.drift_lr_rule == "kl_target" else self._lr_factor

    @property
    def staleness_factor(self) -> float:
        """The LR share an off-policy batch leaves the update (:func:`~.schedule.staleness_lr_factor`);
        1 when synchronous, with ``behaviour_kl_weight`` 0 or with drift-aware LR off."""
        spent = self._spent_by_staleness
        if spent == 0.0 or not self.config.drift_lr:
            return 1.0
        return staleness_lr_factor(spent, self.config.drift_threshold)

    @property
    def lr_factor(self) -> float:
        """Multiplier of the next step's scheduled LR: the drift-aware factor times the early-phase
        warm-up factor (times the staleness factor for an off-policy batch)."""
        factor = self.drift_factor * self.warmup_factor
        if self.behaviour_kl is not None:
            factor *= self.staleness_factor
        return factor

    def loss_config(self, base: LossConfig) -> LossConfig:
        """Copy of ``base`` whose ``dpcc.tau`` is the current tau_t."""
        return dataclasses.replace(base, dpcc=dataclasses.replace(base.dpcc, tau=self.tau))

    # -- update ---------------------------------------------------------------------
    def observe(self, kl: float, fresh: bool = False, *, probe: bool = False, advance: bool = True) -> None:
        """Record a KL(pi_old || pi_new) measurement; with ``advance`` also move to the next step.

        A non-finite ``kl`` (pass NaN when the measurement is unusable, e.g. non-finite
        logits) is counted and otherwise ignored: the KL average, drift score and LR factor
        keep their previous values. So is a ``fresh`` one (measured right after pi_old was
        recomputed) when ``skip_fresh_kl`` is on. ``probe``: the drift probe's reading of the
        whole iteration's drift, which alone moves the KL-target rule's scale.
        """
        c = self.config
        kl = float(kl)
        if not math.isfinite(kl):
            self.counters["nonfinite_kl"] += 1
        elif fresh and c.skip_fresh_kl:
            self.counters["fresh_kl_skipped"] += 1  # D, drift and factor carry over unchanged
        else:
            self._update(kl, probe)
        if advance:
            self.advance()

    def observe_behaviour(self, kl: Optional[float]) -> None:
        """KL(pi_b || pi_prox) of the batch the next steps train on (None: synchronous). A non-finite
        reading is counted and spends nothing."""
        if kl is not None and not math.isfinite(float(kl)):
            self.counters["nonfinite_kl"] += 1
            kl = 0.0
        self.behaviour_kl = None if kl is None else float(kl)

    def advance(self) -> None:
        """One optimizer step was applied (at the current ``lr_factor`` and ``tau``)."""
        self.step += 1
        if self.drift_factor < 1.0:  # drift cuts only, not the warm-up
            self.counters["lr_reduced_steps"] += 1
        if self.tau_adaptive <= self.config.tau_min:
            self.counters["tau_floor_steps"] += 1

    def _update(self, kl: float, probe: bool) -> None:
        """Fold one finite KL observation into D, the drift score and the LR factor or scale."""
        c = self.config
        self.counters["observations"] += 1
        self.last_kl = kl
        self.kl_ema = kl if self.kl_ema is None else c.kl_ema_decay * self.kl_ema + (1.0 - c.kl_ema_decay) * kl
        self.drift = kl if c.drift_score == "kl" else self.kl_ema
        if c.drift_lr_rule == "kl_target":  # only the probe reads an iteration's drift in its units
            if probe:
                self.counters["drift_triggers"] += int(kl > c.drift_threshold)
                self.lr_scale = kl_target_scale(self.lr_scale, kl, c.drift_threshold, c.kl_target_gain,
                                                c.lr_scale_min, c.lr_scale_max_raise)
            return
        if self.drift > c.drift_threshold:
            self.counters["drift_triggers"] += 1
            self._lr_factor = drift_lr_factor(self.drift, c.drift_threshold)
            self._hold = c.drift_hysteresis_steps
        elif self._hold > 0:
            self._hold -= 1  # hysteresis: keep the last reduced factor a little longer
        else:
            self._lr_factor = 1.0

    # -- reporting and checkpointing -------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Scalars for logging (prefix ``dpcc/``); NaN where nothing was observed yet."""
        nan = float("nan")
        out = {
            "dpcc/tau": self.tau,
            "dpcc/tau_adaptive": self.tau_adaptive,
            "dpcc/tau_cap": self.tau_cap,
            "dpcc/kl_ema": self.kl_ema if self.kl_ema is not None else nan,
            "dpcc/kl": self.last_kl if self.last_kl is not None else nan,
            "dpcc/drift": self.drift if self.drift is not None else nan,
            "dpcc/lr_factor": self.lr_factor,
            "dpcc/lr_scale": self.lr_scale,
            "dpcc/warmup_factor": self.warmup_factor,
            "dpcc/step": float(self.step),
        }
        if self.behaviour_kl is not None:
            out["dpcc/behaviour_kl"] = self.behaviour_kl
            out["dpcc/staleness_factor"] = self.staleness_factor
        out.update({f"dpcc/{k}": float(v) for k, v in self.counters.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the future: plain ints, floats and None."""
        return {
            "version": _STATE_VERSION,
            "step": self.step,
            "kl_ema": self.kl_ema,
            "last_kl": self.last_kl,
            "drift": self.drift,
            "lr_factor": self._lr_factor,
            "hold": self._hold,
            "lr_scale": self.lr_scale,
            "behaviour_kl": self.behaviour_kl,
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (the config and total_steps come from the constructor)."""
        if state.get("version") not in _READABLE_VERSIONS:
            raise ValueError(f"DPCCController state version {state.get('version')!r} is not one of "
                             f"{list(_READABLE_VERSIONS)}")
        missing = {"step", "kl_ema", "last_kl", "drift", "lr_factor", "hold", "counters"} - set(state)
        if missing:
            raise ValueError(f"DPCCController state lacks {sorted(missing)}")
        self.step = int(state["step"])
        self.kl_ema = None if state["kl_ema"] is None else float(state["kl_ema"])
        self.last_kl = None if state["last_kl"] is None else float(state["last_kl"])
        self.drift = None if state["drift"] is None else float(state["drift"])
        self._lr_factor = float(state["lr_factor"])
        self._hold = int(state["hold"])
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.behaviour_kl = None if state.get("behaviour_kl") is None else float(state["behaviour_kl"])
        self.counters = {name: int(state["counters"].get(name, 0)) for name in _COUNTERS}
