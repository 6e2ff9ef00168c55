"""The trainer's side of the monitor's control advice: the LR scale it maintains.

    control = MonitorControl(cfg.monitor)
    lr_scale = control.lr_scale                  # multiplies every optimizer step's LR
    control.apply(advice)                        # once per iteration, advice or None

``reduce_lr`` advice multiplies the scale by its factor. After
``monitor.lr_recovery_iterations`` consecutive iterations without new ``reduce_lr`` advice,
the scale recovers one step (divided by ``monitor.reduce_lr_factor``, never above 1), so a
transient alert does not slow the rest of the run forever. A rollback also cuts the scale
(``rolled_back``). The state is part of the checkpoint, so a resumed run goes on at the
same scale with the same healthy streak.
"""
from __future__ import annotations

from typing import Any, Optional


def retention_target(last_healthy: Optional[int], evidence_window: int, cfg: Any) -> Optional[int]:
    """The iteration at or before which checkpoint retention keeps the newest checkpoint, so that the
    next confirmed collapse has one to roll back to (``cfg``: the monitor section).

    The advice goes back to the last healthy iteration, and with ``rollback_before_evidence`` to
    before the alert's window. That window ends at the alert, which comes after this save's last
    healthy iteration, and spans at most ``evidence_window`` iterations: so ``last_healthy -
    evidence_window`` is at or before any such target (``tests/megatron/test_checkpoint.py`` checks
    it). Before any healthy iteration (or when that reaches back past the start): 0, the start, when
    ``rollback_to_start``; else None."""
    if last_healthy is not None:
        target = last_healthy - (evidence_window if cfg.rollback_before_evidence else 0)
        if target >= 0:
            return int(target)
    return 0 if cfg.rollback_to_start else None


class MonitorControl:
    def __init__(self, cfg: Any):
        self.factor = float(cfg.reduce_lr_factor)
        self.recovery = int(cfg.lr_recovery_iterations)
        self.lr_scale = 1.0
        self.healthy_streak = 0
        self.recoveries = 0

    def apply(self, advice: Optional[tuple]) -> None:
        """One iteration's advice ``(action, factor, to_iteration)`` or None (rollbacks: :meth:`rolled_back`)."""
        if advice is not None and advice[0] == "reduce_lr":
            self.lr_scale *= float(advice[1])
            self.healthy_streak = 0
            return
        self.healthy_streak += 1
        if self.recovery and self.lr_scale < 1.0 and self.healthy_streak >= self.recovery:
            self.lr_scale = min(1.0, self.lr_scale / self.factor)
            self.healthy_streak = 0
            self.recoveries += 1

    def rolled_back(self) -> None:
        self.lr_scale *= self.factor
        self.healthy_streak = 0

    def state_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "healthy_streak": self.healthy_streak, "recoveries": self.recoveries}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:  # a checkpoint from before the scale was saved: start at 1
            return
        self.lr_scale = float(state["lr_scale"])
        self.healthy_streak = int(state["healthy_streak"])
        self.recoveries = int(state.get("recoveries", 0))


class SidecarAdvice:
    """Chooses, on rank 0, between the sidecar's advice and the local detector's for one iteration.

    The sidecar's answer is awaited (``monitor.advice_wait_s``) so it lands at a deterministic
    point. When it misses ``monitor.sidecar_down_after`` iterations in a row the sidecar is taken
    as down: the local detector gives the advice from then on, without waiting, and a log line says
    so; records still go to the client (it spools them), and the first acknowledged record switches
    the advice back to the sidecar, with another log line."""

    def __init__(self, cfg: Any, log=print):
        self.wait = float(cfg.advice_wait_s)
        self.down_after = int(cfg.sidecar_down_after)
        self.misses = 0
        self.down = False
        self.fallbacks = 0
        self.log = log

    def answer(self, monitor, iteration: int, local):
        """``local``: the local detector's merged advice (or None). Returns the advice to act on."""
        if self.wait <= 0:
            return monitor.poll_control()
        if monitor.wait_delivered(iteration, 0.0 if self.down else self.wait):
            if self.down:
                self.log(f"[dpcc] monitor sidecar answers again at iteration {iteration}; its advice is used again")
            self.down, self.misses = False, 0
            return monitor.poll_control()
        self.fallbacks += 1
        self.misses += 1
        if not self.down:
            self.log(f"[dpcc] monitor sidecar did not acknowledge iteration {iteration} within {self.wait:g} s "
                     f"(monitor.advice_wait_s); using the local detector's advice for it (fallback {self.fallbacks})")
            if self.misses >= self.down_after:
                self.down = True
                self.log(f"[dpcc] monitor sidecar unresponsive for {self.misses} iterations: the local detector "
                         "gives the control advice until the sidecar answers again")
        return local
