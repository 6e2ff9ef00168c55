"""The trainer's exchange with the collapse monitor: the local detector, the sidecar, and their advice.

    exchange = MonitorExchange(cfg, rank, world, counters, detector, monitor)
    advice = exchange.exchange(record)     # collective: the same (action, factor, to_iteration) or None
    exchange.rolled_back(iteration, detector_state)
    exchange.close()

Only rank 0 holds the detector and the sidecar client; every rank gets the advice.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist


class MonitorExchange:
    def __init__(self, cfg, rank: int, world: int, counters: dict, detector=None, monitor=None):
        self.cfg = cfg
        self.rank, self.world = rank, world
        self.counters = counters
        self.detector = detector
        """The local CollapseDetector (rank 0)."""
        self.monitor = monitor
        """The sidecar's MonitorClient (rank 0, when monitor.enabled and monitor.address)."""
        self.sidecar_advice = None
        """train.control.SidecarAdvice: sidecar vs local-detector advice (rank 0, with a sidecar)."""
        self.alerts: list = []

    def exchange(self, record: dict) -> Optional[tuple]:
        """Rank 0 runs the local detector, sends the record and polls the sidecar's advice.

        Advice comes from the sidecar when one is configured, else from the local detector
        through the same alert -> advice policy, so control works without a sidecar too.
        With a sidecar, rank 0 waits (up to ``monitor.advice_wait_s``) until the sidecar has
        acknowledged this record, so the advice about iteration i is applied before iteration
        i+1 whatever the timing; on time-out the local detector's advice is used (logged, counted).
        Every rank gets the same ``(action, factor, to_iteration)`` back, or None.
        """
        advice = None
        if self.rank == 0:
            advice = self._advice(record)
        if dist.is_initialized() and self.world > 1:
            box = [advice]
            dist.broadcast_object_list(box, src=0)
            advice = box[0]
        return advice

    def _advice(self, record: dict) -> Optional[tuple]:
        from ..monitor.alerts import ControlAdvice, ControlPolicy

        mon = self.cfg.monitor
        local = []
        if self.detector is not None:
            for alert in self.detector.update(record):
                self.alerts.append({"rule": alert.rule, "iteration": alert.iteration, "severity": alert.severity,
                                    "confirmed": alert.confirmed, "message": alert.message})
                print(f"[dpcc] ALERT {alert.severity} {alert.rule} @ {alert.iteration}: {alert.message}", flush=True)
                decided = ControlPolicy(mon).decide(alert, self.detector.last_healthy_iteration)
                if decided is not None:
                    local.append(decided)
        got = ControlAdvice.merge(local) if local else None
        if self.monitor is not None:
            from .control import SidecarAdvice

            if self.sidecar_advice is None:
                self.sidecar_advice = SidecarAdvice(mon, log=lambda m: print(m, flush=True))
            self.monitor.send(record)
            got = self.sidecar_advice.answer(self.monitor, record["iteration"], got)
            self.counters["advice_fallbacks"] = self.sidecar_advice.fallbacks
        if got is not None and mon.acts_on(got.action):
            print(f"[dpcc] control advice: {got.action} ({got.reason})", flush=True)
            return got.action, float(got.factor), got.to_iteration
        if got is not None and got.action != "none" and mon.control_active:
            print(f"[dpcc] control advice not acted on (monitor.act_on: {mon.act_on}): "
                  f"{got.action} ({got.reason})", flush=True)
        return None

    def send_eval(self, iteration: int, metrics: dict) -> None:
        """An evaluation's metrics to the sidecar (kind ``eval``; rank 0)."""
        if self.monitor is not None:
            self.monitor.send({"iteration": iteration, **metrics}, kind="eval")

    def load_detector_state(self, state: Optional[dict]) -> None:
        if self.detector is not None and state:
            self.detector.load_state_dict(state)

    def rolled_back(self, iteration: int, detector_state: Optional[dict]) -> None:
        """A rollback to ``iteration``: the detector goes back with the weights, the sidecar is told."""
        self.load_detector_state(detector_state)
        if self.monitor is not None:
            self.monitor.notify_rollback(iteration)

    def close(self) -> None:
        """Flush and close the sidecar client (rank 0)."""
        if self.monitor is not None:
            self.monitor.close(timeout=5.0)
