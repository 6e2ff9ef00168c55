"""Alerts, control advice and the documented alert -> advice mapping (stdlib only).

Mapping (:class:`ControlPolicy`):

=========================================  ===============================================
alert                                      advice
=========================================  ===============================================
``kl_drift`` (any severity)                ``reduce_lr(factor)`` at once, except a
                                           warning on ``kl_ref`` (a notice: nothing)
``high_entropy`` (any severity)            ``reduce_lr(factor)`` at once
confirmed collapse (``confirmed=True``)    ``rollback(to_iteration=last healthy iteration)``
                                           when ``rollback_on_collapse`` and one is known
                                           (with ``rollback_before_evidence``: no later
                                           than the iteration before the alert's window);
                                           before any healthy iteration ``rollback(0)``
                                           (the run's start) when ``rollback_to_start``;
                                           else ``checkpoint_and_pause`` when
                                           ``pause_on_collapse``, else nothing
anything else                              nothing (log / sinks only)
=========================================  ===============================================

A *confirmed collapse* is a critical alert (``high_entropy`` out of band,
``low_entropy`` on repetition or without learning, ``kl_drift`` over
``kl_critical_threshold``, ``non_finite``) whose condition held for
``collapse_confirm_steps`` consecutive iterations.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

SEVERITIES = ("info", "warning", "critical")
RULES = ("high_entropy", "low_entropy", "kl_drift", "non_finite", "grad_spike", "reward_collapse",
         "sampler_mismatch", "reward_drop")
ACTIONS = ("none", "reduce_lr", "checkpoint_and_pause", "rollback")
_PRIORITY = {a: i for i, a in enumerate(ACTIONS)}


@dataclass
class Alert:
    """One detector finding."""

    rule: str
    """Rule name, one of :data:`RULES`."""
    severity: str
    """``warning`` or ``critical``."""
    iteration: int
    """Iteration of the record that triggered it."""
    message: str
    """Human-readable explanation (names the KL estimator for kl_drift)."""
    metric: str
    """Field the rule looked at (``entropy``, ``kl_old_new``...; a comma list for non_finite)."""
    window: list
    """The metric window that triggered it: ``[[iteration, value], ...]``, oldest first."""
    confirmed: bool = False
    """True when the condition held ``collapse_confirm_steps`` steps: a confirmed collapse."""
    run_id: str = "default"
    attempt: int = 0
    details: dict = field(default_factory=dict)
    """Rule-specific extras: thresholds, band, estimator, last healthy iteration."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Alert":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def summary(self) -> dict:
        return {"rule": self.rule, "iteration": self.iteration, "severity": self.severity}

    def __str__(self) -> str:
        tag = " CONFIRMED" if self.confirmed else ""
        return f"[{self.severity.upper()}{tag}] {self.rule} @ iteration {self.iteration}: {self.message}"


@dataclass
class ControlAdvice:
    """What the sidecar recommends the trainer do. Delivered at most once by
    :meth:`MonitorClient.poll_control` (advice that arrived between two polls is merged:
    the strongest action wins and ``reduce_lr`` factors multiply)."""

    action: str
    """``none``, ``reduce_lr``, ``checkpoint_and_pause`` or ``rollback``."""
    factor: float = 1.0
    """For ``reduce_lr``: multiply the LR by this (< 1)."""
    to_iteration: Optional[int] = None
    """For ``rollback``: roll back to the newest checkpoint at or before this iteration."""
    iteration: int = -1
    """Iteration of the record that caused it."""
    rules: list = field(default_factory=list)
    """Rules of the alerts behind it."""
    reason: str = ""
    """Messages of the alerts behind it."""
    seq: int = 0
    """Monotonic id assigned by the sidecar (persisted across sidecar restarts)."""
    run_id: str = "default"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ControlAdvice":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    @staticmethod
    def merge(advices: list["ControlAdvice"]) -> Optional["ControlAdvice"]:
        """Fold several pending advices into one (strongest action; reduce_lr factors multiply)."""
        advices = [a for a in advices if a.action != "none"]
        if not advices:
            return None
        best = max(advices, key=lambda a: (_PRIORITY.get(a.action, 0), a.seq))
        factor = 1.0
        for a in advices:
            if a.action == "reduce_lr":
                factor *= a.factor
        rules: list = []
        for a in advices:
            rules.extend(r for r in a.rules if r not in rules)
        return ControlAdvice(
            action=best.action,
            factor=factor if best.action == "reduce_lr" else best.factor,
            to_iteration=best.to_iteration,
            iteration=max(a.iteration for a in advices),
            rules=rules,
            reason="; ".join(a.reason for a in advices if a.reason),
            seq=max(a.seq for a in advices),
            run_id=best.run_id,
        )


def rollback_target(last_healthy: Optional[int], window=None) -> Optional[int]:
    """The iteration a confirmed collapse rolls back to: the last healthy one, and with the alert's
    evidence ``window`` (``[[iteration, value], ...]``) no later than the iteration before it starts;
    None when there is none (no healthy iteration, or the evidence starts at iteration 0)."""
    if last_healthy is None:
        return None
    target = int(last_healthy)
    starts = [int(w[0]) for w in (window or []) if isinstance(w, (list, tuple)) and w]
    if starts:
        target = min(target, min(starts) - 1)
    return target if target >= 0 else None


class ControlPolicy:
    """Alert -> advice mapping (see the module docstring). ``cfg`` is a MonitorConfig."""

    def __init__(self, cfg: Any):
        active = getattr(cfg, "control_active", None)
        self.enabled = bool(active if active is not None else getattr(cfg, "control_enabled", True))
        self.factor = float(getattr(cfg, "reduce_lr_factor", 0.5))
        self.rollback = bool(getattr(cfg, "rollback_on_collapse", True))
        self.pause = bool(getattr(cfg, "pause_on_collapse", True))
        self.to_start = bool(getattr(cfg, "rollback_to_start", True))
        self.before_evidence = bool(getattr(cfg, "rollback_before_evidence", True))

    def decide(self, alert: Alert, last_healthy: Optional[int]) -> Optional[ControlAdvice]:
        if not self.enabled:
            return None
        common = dict(iteration=alert.iteration, rules=[alert.rule], reason=str(alert), run_id=alert.run_id)
        if alert.confirmed:
            target = rollback_target(last_healthy, alert.window if self.before_evidence else None)
            if self.rollback and (target is not None or self.to_start):
                return ControlAdvice(action="rollback", to_iteration=0 if target is None else target, **common)
            if self.pause:
                return ControlAdvice(action="checkpoint_and_pause", **common)
            return None
        if alert.rule == "kl_drift" and alert.metric == "kl_ref":
            # The KL to the reference is a level that a learning run raises too: a warning on it came after the
            # first critical of every held-out collapse (benchmarks/monitor/RESULTS.md#eighth-calibration), and an LR cut
            # would repeat every alert_cooldown while it stays high. A notice, not advice.
            return None
        if alert.rule in ("kl_drift", "high_entropy"):
            return ControlAdvice(action="reduce_lr", factor=self.factor, **common)
        return None
