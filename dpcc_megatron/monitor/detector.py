"""Collapse detector: rules over the per-iteration metric stream (pure python, stdlib only).

Rules (names are stable; see docs/monitor.md for defaults):

- ``high_entropy``  entropy above the normal band (critical) or rising by more than
  ``entropy_jump`` x band centre within ``entropy_jump_window`` steps (warning).
- ``low_entropy``   ``repetition_rate >= repetition_threshold`` or ``longest_repeat >=
  longest_repeat_threshold`` (critical), and/or entropy below the band (before calibration:
  below ``entropy_floor_ratio`` x the healthy mean so far) for ``low_entropy_patience``
  consecutive steps. With ``mastered_reward_gain`` set: no alert while the reward's mean over
  the last 3 iterations is at least that much above its mean over the healthy iterations (a
  task being mastered; the steps stay healthy), else critical (the policy turned deterministic
  without learning). Without it: a warning, critical when the reward signal is gone too and
  reward_mean fell ``low_entropy_reward_drop`` below its best healthy value (a template collapse).
- ``kl_drift``      ``kl_old_new > kl_threshold`` for ``kl_window`` consecutive batches
  (also ``kl_ref`` above ``kl_ref_threshold``); the estimator is named (``kl_ref_estimator``
  for ``kl_ref``). Critical when one iteration's KL exceeds ``kl_critical_threshold`` (a
  runaway update), when it stays above ``kl_sustained_threshold`` for ``kl_sustained_window``
  consecutive iterations (a step size that drifts), or when one iteration's ``kl_ref`` (sent
  while a reference model exists) exceeds ``kl_ref_critical_threshold`` (the policy drifted
  far from the reference). In an iteration of one optimizer step (``optimizer_steps`` 1) the KL read
  is the after-step probe's, and the three KL thresholds are multiplied by
  ``kl_one_step_factor``.

The entropy band is ``entropy_band`` when set, else ``entropy_band_relative`` x the first
record's entropy (the starting policy's), else calibrated from the first
``entropy_calibration_steps`` healthy steps.

When a record carries the rule track's reward statistics (``reward_base_mean``,
``reward_base_std``, ``zero_var_frac_base``) or the iteration's largest per-step KL
(``kl_step_max``), the rules read those in place of ``reward_mean``, ``reward_std``,
``zero_var_frac`` and ``kl_old_new`` (:func:`judged_view`).
- ``non_finite``    any numeric field NaN/Inf (critical).
- ``grad_spike``    ``grad_norm > grad_spike_factor x median`` of the previous
  ``grad_spike_window`` steps (warning).
- ``reward_collapse`` reward variance collapsed (``reward_std < reward_std_min`` or
  ``zero_var_frac >= zero_var_frac_max``) for ``reward_collapse_patience`` steps (warning; not
  while the task is being mastered in the sense of ``mastered_reward_gain``).
- ``sampler_mismatch`` ``mismatch_kl > mismatch_kl_threshold`` for ``kl_window`` batches
  (warning; off unless the threshold is set). Records of stale batches (``staleness_max`` > 0) are
  not judged: their sampler ran older weights, and ``kl_behaviour`` reports that distance.
- ``reward_drop``   the mean of the last ``reward_drop_window`` rewards below
  ``(1 - reward_drop_fraction) x`` its best value at a healthy iteration, for
  ``reward_drop_patience`` consecutive iterations, once that best is positive and at least
  ``reward_drop_min_best`` (critical; off when the fraction is null). Reactive: it reads the reward's level itself.
  With ``reward_drop_confirm`` it also waits for a second signal: the latest held-out evaluation
  (``eval``: ``reward_drop_eval_field`` below ``(1 - reward_drop_eval_fraction) x`` its best at a
  healthy iteration) or the in-group answer diversity (``diversity``: ``answer_distinct_frac``'s
  trailing mean moved by ``reward_drop_diversity_change`` x its value where the best reward was set).
  Without the field the reward alone decides; for ``eval`` also in a run that evaluates only at its
  start, and once the latest evaluation is ``reward_drop_eval_max_age`` iterations old.

A rule alerts when its condition starts to hold, again after ``alert_cooldown``
iterations while it keeps holding, and again when its severity escalates. A critical
condition holding ``collapse_confirm_steps`` consecutive steps raises one extra alert
with ``confirmed=True`` (a confirmed collapse). Steps on which no rule holds are
*healthy*; they calibrate the entropy band (first K of them) and define
``last_healthy_iteration``, the rollback target.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Mapping, Optional

from .alerts import RULES, Alert
from .records import ENVELOPE_KEYS, is_finite

_SEV_RANK = {"info": 0, "warning": 1, "critical": 2}

#: Fields a record may carry that the rules read in place of the plain ones: the rule (base)
#: track's reward statistics, so contrastive tie-breakers cannot hide a lost learning signal,
#: and the largest per-step KL of the iteration, so the ~0 KL of each iteration's fresh first
#: step does not dilute the drift.
JUDGED_FIELDS = {"reward_mean": "reward_base_mean", "reward_std": "reward_base_std",
                 "zero_var_frac": "zero_var_frac_base", "kl_old_new": "kl_step_max"}


def judged_view(record: Mapping) -> dict:
    """The record as the rules read it (see :data:`JUDGED_FIELDS`)."""
    view = dict(record)
    for plain, better in JUDGED_FIELDS.items():
        if is_finite(record.get(better)):
            view[plain] = record[better]
    return view
_TRACKED = ("entropy", "kl_old_new", "kl_ref", "mismatch_kl", "repetition_rate", "longest_repeat",
            "grad_norm", "reward_std", "zero_var_frac", "reward_mean", "answer_distinct_frac")
#: Iterations in the trailing mean of the (judged) reward that the low-entropy rule compares.
REWARD_SMOOTH = 3


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else repr(v)


def _default_cfg() -> Any:
    from ..config.monitor import MonitorConfig

    return MonitorConfig()


class _Hit:
    __slots__ = ("severity", "message", "metric", "window", "details")

    def __init__(self, severity: str, message: str, metric: str, window: list, details: Optional[dict] = None):
        self.severity, self.message, self.metric, self.window = severity, message, metric, window
        self.details = details or {}


class CollapseDetector:
    """Stateful rule engine. ``cfg`` is a :class:`MonitorConfig` (or any object with its
    detector attributes); ``update(record)`` returns the alerts that record raised."""

    def __init__(self, cfg: Any = None, run_id: str = "default"):
        self.cfg = cfg if cfg is not None else _default_cfg()
        self.run_id = run_id
        c = self.cfg
        self._hist_len = max(c.kl_window, c.kl_sustained_window, c.entropy_jump_window,
                             c.grad_spike_window + 1,
                             c.reward_collapse_patience, c.low_entropy_patience, c.collapse_confirm_steps,
                             c.reward_drop_patience, c.reward_drop_window, 2)
        self.evidence_window = max(c.entropy_jump_window, c.low_entropy_patience, c.collapse_confirm_steps,
                                   c.kl_window, c.kl_sustained_window, c.reward_drop_window,
                                   c.reward_drop_patience, 1)
        """The most iterations the evidence (window) of a critical, confirmable alert spans: rollback
        and checkpoint retention read it (warning-only rules, such as grad_spike, never roll back)."""
        self.band: Optional[tuple[float, float]] = tuple(c.entropy_band) if c.entropy_band is not None else None
        self.band_source: Optional[str] = "config" if self.band is not None else None
        self._calib: list[float] = []
        self.attempt = 0
        self.last_iteration: Optional[int] = None
        self.last_healthy_iteration: Optional[int] = None
        self.best_healthy_reward: Optional[float] = None
        self.best_healthy_reward_trailing: Optional[float] = None
        """Best mean of the last ``reward_drop_window`` rewards at a healthy iteration (reward_drop's line)."""
        self.healthy_reward_sum, self.healthy_reward_n = 0.0, 0
        self.kl_estimator: Optional[str] = None
        self.kl_ref_estimator: Optional[str] = None
        """The estimator of ``kl_ref`` (``loss.kl_estimator``, which may differ from ``kl_old_new``'s)."""
        self.records_seen = 0
        self.ignored_out_of_order = 0
        self._judged: dict[str, str] = {}
        self._mastered = False
        self._trailing: Optional[float] = None
        """This record's trailing reward mean (``_trailing_reward``), read by reward_drop and the healthy update."""
        self.latest_eval: Optional[float] = None
        """The last value of ``reward_drop_eval_field`` a record carried (reward_drop's "eval" confirmation)."""
        self.best_healthy_eval: Optional[float] = None
        self.latest_eval_iteration: Optional[int] = None
        """The iteration whose record carried ``latest_eval``: 0 in a run that evaluates only at its start
        (nothing to wait for); its age is bounded by reward_drop_eval_max_age."""
        self.diversity_at_best: Optional[float] = None
        """Trailing answer diversity at the iteration that set ``best_healthy_reward_trailing``."""
        self._diversity: Optional[float] = None
        self._reset_windows()

    # ------------------------------------------------------------------ state
    def _reset_windows(self) -> None:
        self._hist: dict[str, deque] = {k: deque(maxlen=self._hist_len) for k in _TRACKED}
        self._counters: dict[str, int] = {"kl_old_new": 0, "kl_ref": 0, "mismatch_kl": 0, "below_band": 0,
                                          "reward": 0, "kl_sustained": 0, "reward_drop": 0}
        self._streak = {r: 0 for r in RULES}
        self._crit_streak = {r: 0 for r in RULES}
        self._last_fired: dict[str, Optional[int]] = {r: None for r in RULES}
        self._fired_sev = {r: "" for r in RULES}
        self._confirmed = {r: False for r in RULES}

    def state_dict(self) -> dict:
        """JSON-serialisable state (the sidecar persists it in SQLite after every batch)."""
        return {
            "version": 1,
            "run_id": self.run_id,
            "band": list(self.band) if self.band is not None else None,
            "band_source": self.band_source,
            "calib": list(self._calib),
            "attempt": self.attempt,
            "last_iteration": self.last_iteration,
            "last_healthy_iteration": self.last_healthy_iteration,
            "best_healthy_reward": self.best_healthy_reward,
            "best_healthy_reward_trailing": self.best_healthy_reward_trailing,
            "latest_eval": self.latest_eval,
            "best_healthy_eval": self.best_healthy_eval,
            "latest_eval_iteration": self.latest_eval_iteration,
            "diversity_at_best": self.diversity_at_best,
            "healthy_reward": [self.healthy_reward_sum, self.healthy_reward_n],
            "kl_estimator": self.kl_estimator,
            "kl_ref_estimator": self.kl_ref_estimator,
            "records_seen": self.records_seen,
            "ignored_out_of_order": self.ignored_out_of_order,
            "hist": {k: [list(x) for x in v] for k, v in self._hist.items()},
            "counters": dict(self._counters),
            "streak": dict(self._streak),
            "crit_streak": dict(self._crit_streak),
            "last_fired": dict(self._last_fired),
            "fired_sev": dict(self._fired_sev),
            "confirmed": dict(self._confirmed),
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported detector state version {state.get('version')!r}")
        self.run_id = state.get("run_id", self.run_id)
        if self.band_source != "config":  # an explicitly configured band wins over a saved one
            band = state.get("band")
            self.band = tuple(band) if band is not None else None
            self.band_source = state.get("band_source")
        self._calib = list(state.get("calib", []))
        self.attempt = int(state.get("attempt", 0))
        self.last_iteration = state.get("last_iteration")
        self.last_healthy_iteration = state.get("last_healthy_iteration")
        self.best_healthy_reward = state.get("best_healthy_reward")
        self.best_healthy_reward_trailing = state.get("best_healthy_reward_trailing")
        self.latest_eval = state.get("latest_eval")
        self.best_healthy_eval = state.get("best_healthy_eval")
        self.latest_eval_iteration = state.get("latest_eval_iteration")
        self.diversity_at_best = state.get("diversity_at_best")
        self.healthy_reward_sum, self.healthy_reward_n = state.get("healthy_reward", [0.0, 0])
        self.kl_estimator = state.get("kl_estimator")
        self.kl_ref_estimator = state.get("kl_ref_estimator")
        self.records_seen = int(state.get("records_seen", 0))
        self.ignored_out_of_order = int(state.get("ignored_out_of_order", 0))
        self._reset_windows()
        for k, v in state.get("hist", {}).items():
            if k in self._hist:
                self._hist[k].extend(tuple(x) for x in v)
        for name, target in (("counters", self._counters), ("streak", self._streak),
                             ("crit_streak", self._crit_streak), ("last_fired", self._last_fired),
                             ("fired_sev", self._fired_sev), ("confirmed", self._confirmed)):
            for k, v in state.get(name, {}).items():
                if k in target:
                    target[k] = v

    # ------------------------------------------------------------------ stream
    def update(self, record: Mapping) -> list[Alert]:
        """Feed one record (same field names as the trainer sends); return new alerts.

        Records of an older attempt, or not newer than the last seen iteration of the
        current attempt, are ignored (counted in ``ignored_out_of_order``)."""
        it = int(record["iteration"])
        attempt = int(record.get("attempt", 0) or 0)
        if attempt < self.attempt or (attempt == self.attempt and self.last_iteration is not None
                                      and it <= self.last_iteration):
            self.ignored_out_of_order += 1
            return []
        if attempt > self.attempt:  # a new trainer segment (restart or rollback)
            self.attempt = attempt
            if self.last_iteration is not None and it <= self.last_iteration:
                # it rewound: the windows describe iterations that no longer exist; keep the band
                self._reset_windows()
                self.latest_eval = self.latest_eval_iteration = None  # it evaluated the abandoned branch
                if self.last_healthy_iteration is not None:
                    self.last_healthy_iteration = min(self.last_healthy_iteration, it - 1)
        self.last_iteration = it
        self.records_seen += 1
        # which plain fields this record's rules read from a better one (named in the alert messages)
        self._judged = {plain: better for plain, better in JUDGED_FIELDS.items() if is_finite(record.get(better))}
        record = judged_view(record)
        est = record.get("kl_estimator")
        if isinstance(est, str) and est:
            self.kl_estimator = est
        ref_est = record.get("kl_ref_estimator")
        if isinstance(ref_est, str) and ref_est:
            self.kl_ref_estimator = ref_est

        vals = {k: record.get(k) for k in _TRACKED}
        rel = self.cfg.entropy_band_relative
        if self.band_source is None and rel is not None and is_finite(vals["entropy"]) and vals["entropy"] > 0:
            # the first record's entropy is the starting policy's (measured before its update)
            e0 = float(vals["entropy"])
            self.band, self.band_source = (rel[0] * e0, rel[1] * e0), f"{rel[0]:g}-{rel[1]:g} x the first entropy"
        for k, v in vals.items():
            if is_finite(v):
                self._hist[k].append((it, float(v)))

        self._trailing = self._trailing_reward() if is_finite(vals["reward_mean"]) else None
        self._diversity = self._trailing_mean("answer_distinct_frac") if is_finite(vals["answer_distinct_frac"]) else None
        ev = record.get(self.cfg.reward_drop_eval_field)
        if is_finite(ev):
            self.latest_eval, self.latest_eval_iteration = float(ev), it
        hits: dict[str, _Hit] = {}
        self._mastered = False
        for rule, fn in (("non_finite", self._rule_non_finite), ("high_entropy", self._rule_high_entropy),
                         ("low_entropy", self._rule_low_entropy), ("kl_drift", self._rule_kl),
                         ("sampler_mismatch", self._rule_mismatch), ("grad_spike", self._rule_grad_spike),
                         ("reward_collapse", self._rule_reward), ("reward_drop", self._rule_reward_drop)):
            hit = fn(record, it)
            if hit is not None:
                hits[rule] = hit

        alerts = self._fire(hits, it)
        # A step below the entropy floor (or under the reward_drop line) whose patience has not run out yet is
        # not healthy either:
        # it must not calibrate the band, raise the best reward, or become the rollback target
        # (unless the task is being mastered: low entropy with a reward that rose, see _rule_low_entropy).
        if not hits and (self._counters["below_band"] == 0 or self._mastered) and self._counters["reward_drop"] == 0:
            self.last_healthy_iteration = it
            r = record.get("reward_mean")
            if is_finite(r) and (self.best_healthy_reward is None or r > self.best_healthy_reward):
                self.best_healthy_reward = float(r)
            if self._trailing is not None and (self.best_healthy_reward_trailing is None
                                               or self._trailing > self.best_healthy_reward_trailing):
                self.best_healthy_reward_trailing = self._trailing
                self.diversity_at_best = self._diversity
            if is_finite(ev) and (self.best_healthy_eval is None or ev > self.best_healthy_eval):
                self.best_healthy_eval = float(ev)
            if is_finite(r) and not self._mastered:
                self.healthy_reward_sum += float(r)
                self.healthy_reward_n += 1
            e = vals["entropy"]
            if self.band_source is None and is_finite(e):
                self._calib.append(float(e))
                if len(self._calib) >= self.cfg.entropy_calibration_steps:
                    self._calibrate()
        return alerts

    def _calibrate(self) -> None:
        mean = statistics.fmean(self._calib)
        std = statistics.pstdev(self._calib)
        half = max(self.cfg.entropy_band_sigmas * std, self.cfg.entropy_band_min_halfwidth * abs(mean), 1e-6)
        self.band = (max(0.0, mean - half), mean + half)
        self.band_source = "calibrated"

    def _fire(self, hits: dict[str, _Hit], it: int) -> list[Alert]:
        alerts = []
        confirm = self.cfg.collapse_confirm_steps
        for rule in RULES:
            hit = hits.get(rule)
            if hit is None:
                self._streak[rule] = 0
                self._crit_streak[rule] = 0
                self._confirmed[rule] = False
                self._fired_sev[rule] = ""
                continue
            self._streak[rule] += 1
            critical = hit.severity == "critical"
            self._crit_streak[rule] = self._crit_streak[rule] + 1 if critical else 0
            details = dict(hit.details)
            details["last_healthy_iteration"] = self.last_healthy_iteration
            details["streak"] = self._streak[rule]
            confirmed = critical and self._crit_streak[rule] >= confirm and not self._confirmed[rule]
            last = self._last_fired[rule]
            escalated = _SEV_RANK[hit.severity] > _SEV_RANK.get(self._fired_sev[rule], -1)
            if confirmed:
                self._confirmed[rule] = True
                msg = f"{hit.message} (condition held {self._crit_streak[rule]} consecutive steps: confirmed collapse)"
            elif self._streak[rule] == 1 or escalated or last is None or it - last >= self.cfg.alert_cooldown:
                msg = hit.message
            else:
                continue
            self._last_fired[rule] = it
            self._fired_sev[rule] = hit.severity
            alerts.append(Alert(rule=rule, severity=hit.severity, iteration=it, message=msg, metric=hit.metric,
                                window=hit.window, confirmed=confirmed, run_id=self.run_id,
                                attempt=self.attempt, details=details))
        return alerts

    def _window(self, key: str, n: int) -> list:
        h = self._hist[key]
        return [list(x) for x in list(h)[-n:]]

    # ------------------------------------------------------------------ rules
    def _rule_non_finite(self, rec: Mapping, it: int) -> Optional[_Hit]:
        bad = {}
        for k, v in rec.items():
            if k in ENVELOPE_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                bad[k] = v
        if not bad:
            return None
        names = ", ".join(sorted(bad))
        return _Hit("critical", f"non-finite values in {names}", ",".join(sorted(bad)),
                    [[it, {k: bad[k] for k in sorted(bad)}]], {"fields": sorted(bad)})

    def _rule_high_entropy(self, rec: Mapping, it: int) -> Optional[_Hit]:
        e = rec.get("entropy")
        if not is_finite(e):
            return None
        c = self.cfg
        reasons, severity, details = [], None, {"band": list(self.band) if self.band else None,
                                                 "band_source": self.band_source}
        if self.band is not None and e > self.band[1]:
            severity = "critical"
            reasons.append(f"entropy {e:.4g} above the normal band [{self.band[0]:.4g}, {self.band[1]:.4g}]"
                           f" ({self.band_source})")
        prev = [v for _, v in list(self._hist["entropy"])[-c.entropy_jump_window:-1]]
        if prev:
            low = min(prev)
            scale = (self.band[0] + self.band[1]) / 2 if self.band is not None else low
            rise = e - low
            if scale > 0 and rise >= c.entropy_jump * scale:
                severity = severity or "warning"
                reasons.append(f"entropy jumped {low:.4g} -> {e:.4g} (+{rise:.4g}) within "
                               f"{c.entropy_jump_window} steps (limit +{c.entropy_jump * scale:.4g})")
                details["jump"] = rise
        if severity is None:
            return None
        return _Hit(severity, "; ".join(reasons), "entropy", self._window("entropy", c.entropy_jump_window), details)

    def _rule_low_entropy(self, rec: Mapping, it: int) -> Optional[_Hit]:
        c = self.cfg
        reasons, severity, metric, details = [], None, "", {}
        rep = rec.get("repetition_rate")
        if is_finite(rep) and rep >= c.repetition_threshold:
            severity, metric = "critical", "repetition_rate"
            reasons.append(f"repetition_rate {rep:.3g} >= {c.repetition_threshold:.3g}")
            details["repetition_threshold"] = c.repetition_threshold
        lr = rec.get("longest_repeat")
        if c.longest_repeat_threshold > 0 and is_finite(lr) and lr >= c.longest_repeat_threshold:
            severity, metric = "critical", metric or "longest_repeat"
            reasons.append(f"longest_repeat {lr:g} >= {c.longest_repeat_threshold}")
        e, floor = rec.get("entropy"), self._entropy_floor()
        if floor is not None and is_finite(e):
            self._counters["below_band"] = self._counters["below_band"] + 1 if e < floor else 0
            if self._counters["below_band"] >= c.low_entropy_patience:
                template = self._template_collapse(rec)
                gain = c.mastered_reward_gain
                learned = self._learned(gain) if gain is not None else None
                if learned is not None and learned[0] and not template:
                    # a task being mastered: entropy falls because the reward rose (healthy, no alert)
                    self._mastered = True
                    return _Hit(severity, "; ".join(reasons), metric, self._window(metric, c.collapse_confirm_steps),
                                details) if severity else None
                if learned is not None and not template:
                    template = (f"while the {self._name('reward_mean')} mean of the last {REWARD_SMOOTH} "
                                f"iterations ({learned[1]:.4g}) is not {gain:g} above its healthy mean "
                                f"({learned[2]:.4g}): the policy turned deterministic without learning")
                severity = "critical" if template else (severity or "warning")
                metric = metric or "entropy"
                where = (f"the band [{self.band[0]:.4g}, {self.band[1]:.4g}]" if self.band is not None else
                         f"{c.entropy_floor_ratio:g} x the healthy mean so far ({floor:.4g}, band not calibrated)")
                reasons.append(f"entropy {e:.4g} below {where} for {self._counters['below_band']} steps")
                if template:
                    reasons.append(template)
                details.update(band=list(self.band) if self.band is not None else None, entropy_floor=floor)
        if severity is None:
            return None
        n = max(c.low_entropy_patience, 1) if metric == "entropy" else max(c.collapse_confirm_steps, 1)
        return _Hit(severity, "; ".join(reasons), metric, self._window(metric, n), details)

    def _learned(self, gain: float) -> Optional[tuple]:
        """(learned?, recent reward mean, healthy reward mean), or None before any healthy reward."""
        recent = [v for _, v in list(self._hist["reward_mean"])[-REWARD_SMOOTH:]]
        if not recent or self.healthy_reward_n == 0:
            return None
        now, ref = statistics.fmean(recent), self.healthy_reward_sum / self.healthy_reward_n
        return now >= ref + gain, now, ref

    def _entropy_floor(self) -> Optional[float]:
        """Lower edge of normal entropy: the band's, or before calibration a fraction of the healthy mean."""
        if self.band is not None:
            return self.band[0]
        if self.cfg.entropy_floor_ratio > 0 and self._calib:
            return self.cfg.entropy_floor_ratio * statistics.fmean(self._calib)
        return None

    def _template_collapse(self, rec: Mapping) -> str:
        """Why low entropy is a collapse rather than a mastered task ("" when it is not)."""
        c = self.cfg
        drop, best, mean = c.low_entropy_reward_drop, self.best_healthy_reward, rec.get("reward_mean")
        if drop is None or best is None or not is_finite(mean) or mean > best - drop:
            return ""
        if not self._no_reward_signal(rec):
            return ""
        return (f"with no reward signal ({self._reward_fields(rec)}) and {self._name('reward_mean')} {mean:.4g} "
                f"below its best healthy {best:.4g} by >= {drop:g}: a template collapse")

    def _name(self, plain: str) -> str:
        """The field a rule actually read for ``plain`` in the current record (see JUDGED_FIELDS)."""
        return self._judged.get(plain, plain)

    def _reward_fields(self, rec: Mapping) -> str:
        return ", ".join(f"{self._name(k)}={_fmt(rec.get(k))}" for k in ("reward_std", "zero_var_frac"))

    def _consecutive(self, rec: Mapping, key: str, threshold: Optional[float]) -> bool:
        if threshold is None:
            return False
        v = rec.get(key)
        if is_finite(v):
            self._counters[key] = self._counters[key] + 1 if v > threshold else 0
        return self._counters[key] >= self.cfg.kl_window

    def _rule_kl(self, rec: Mapping, it: int) -> Optional[_Hit]:
        c = self.cfg
        est = self.kl_estimator or "unspecified"
        ref_est = self.kl_ref_estimator or est  # records from before the field: one estimator for both
        step = "kl_old_new" in self._judged
        # One optimizer step: kl_step_max is the after-step reading, a larger quantity (kl_one_step_factor).
        factor = c.kl_one_step_factor if step and rec.get("optimizer_steps") == 1 else 1.0
        scaled = lambda t: None if t is None else t * factor  # noqa: E731
        kl_thr = c.kl_threshold * factor
        hit_new = self._consecutive(rec, "kl_old_new", kl_thr)
        hit_ref = self._consecutive(rec, "kl_ref", c.kl_ref_threshold)
        crit = scaled(c.kl_critical_threshold)
        kl = rec.get("kl_old_new")
        runaway = crit is not None and is_finite(kl) and kl > crit
        sus, sus_n = scaled(c.kl_sustained_threshold), c.kl_sustained_window
        if sus is not None and is_finite(kl):
            self._counters["kl_sustained"] = self._counters["kl_sustained"] + 1 if kl > sus else 0
        sustained = sus is not None and self._counters["kl_sustained"] >= sus_n
        ref, ref_crit = rec.get("kl_ref"), c.kl_ref_critical_threshold
        ref_far = ref_crit is not None and is_finite(ref) and ref > ref_crit
        if not (hit_new or hit_ref or runaway or sustained or ref_far):
            return None
        what_new = "largest per-step KL(pi_old||pi_new) (kl_step_max)" if step else "KL(pi_old||pi_new)"
        if factor != 1.0:
            what_new = f"after-step KL of the only optimizer step (kl_step_max, thresholds x{factor:g} kl_one_step_factor)"
        metric_new = "kl_step_max" if step else "kl_old_new"
        details = {"estimator": est, "window": c.kl_window, "kl_ref_also": hit_new and hit_ref,
                   "threshold_factor": factor}
        if runaway:
            msg = (f"{what_new} [estimator {est}] {kl:.4g} > {crit:g} (kl_critical_threshold) in one iteration: "
                   f"a runaway update")
            details.update(threshold=crit, judged_on=metric_new)
            return _Hit("critical", msg, metric_new, self._window("kl_old_new", c.kl_window), details)
        if sustained:
            msg = (f"{what_new} [estimator {est}] above {sus:g} (kl_sustained_threshold) for "
                   f"{self._counters['kl_sustained']} consecutive iterations, latest {kl:.4g}: the step size drifts")
            details.update(threshold=sus, window=sus_n, judged_on=metric_new)
            return _Hit("critical", msg, metric_new, self._window("kl_old_new", sus_n), details)
        if ref_far:
            msg = (f"KL to the reference (kl_ref) [estimator {ref_est}] {ref:.4g} > {ref_crit:g} "
                   f"(kl_ref_critical_threshold): the policy has drifted far from the reference")
            details.update(threshold=ref_crit, judged_on="kl_ref", estimator=ref_est)
            return _Hit("critical", msg, "kl_ref", self._window("kl_ref", c.kl_window), details)
        key, thr, what = (("kl_old_new", kl_thr, what_new) if hit_new
                          else ("kl_ref", c.kl_ref_threshold, "KL to reference (kl_ref)"))
        if key == "kl_ref":
            est = details["estimator"] = ref_est
        msg = (f"{what} [estimator {est}] > {thr:g} for {self._counters[key]} consecutive batches "
               f"(window {c.kl_window}), latest {self._hist[key][-1][1]:.4g}")
        metric = metric_new if key == "kl_old_new" else key
        details.update(threshold=thr, judged_on=metric)
        return _Hit("warning", msg, metric, self._window(key, c.kl_window), details)

    def _rule_mismatch(self, rec: Mapping, it: int) -> Optional[_Hit]:
        c = self.cfg
        staleness = rec.get("staleness_max")
        if is_finite(staleness) and staleness > 0:
            # sampled by older weights: a mismatch_kl there (from a trainer that sends one) measures
            # staleness, which kl_behaviour reports; the record neither counts nor breaks the window
            return None
        if not self._consecutive(rec, "mismatch_kl", c.mismatch_kl_threshold):
            return None
        return _Hit("warning", f"sampler/trainer mismatch_kl > {c.mismatch_kl_threshold:g} for "
                    f"{self._counters['mismatch_kl']} consecutive batches (not policy drift)", "mismatch_kl",
                    self._window("mismatch_kl", c.kl_window), {"threshold": c.mismatch_kl_threshold})

    def _rule_grad_spike(self, rec: Mapping, it: int) -> Optional[_Hit]:
        c = self.cfg
        g = rec.get("grad_norm")
        if not is_finite(g):
            return None
        prev = [v for _, v in list(self._hist["grad_norm"])[:-1]][-c.grad_spike_window:]
        if len(prev) < c.grad_spike_min_history:
            return None
        med = statistics.median(prev)
        if med <= 0 or g <= c.grad_spike_factor * med:
            return None
        return _Hit("warning", f"grad_norm {g:.4g} > {c.grad_spike_factor:g} x recent median {med:.4g}",
                    "grad_norm", self._window("grad_norm", c.grad_spike_window + 1),
                    {"median": med, "factor": c.grad_spike_factor})

    def _no_reward_signal(self, rec: Mapping) -> bool:
        """reward_std below reward_std_min or zero_var_frac at or above zero_var_frac_max."""
        c, std, zv = self.cfg, rec.get("reward_std"), rec.get("zero_var_frac")
        return bool((is_finite(std) and std < c.reward_std_min) or (is_finite(zv) and zv >= c.zero_var_frac_max))

    def _rule_reward(self, rec: Mapping, it: int) -> Optional[_Hit]:
        c = self.cfg
        std, zv = rec.get("reward_std"), rec.get("zero_var_frac")
        if not (is_finite(std) or is_finite(zv)):
            return None
        self._counters["reward"] = self._counters["reward"] + 1 if self._no_reward_signal(rec) else 0
        if self._counters["reward"] < c.reward_collapse_patience:
            return None
        gain = c.mastered_reward_gain
        learned = self._learned(gain) if gain is not None else None
        if learned is not None and learned[0]:
            return None  # uniform groups because the task is solved, not because the signal is lost
        key = "reward_std" if is_finite(std) and std < c.reward_std_min else "zero_var_frac"
        mean = rec.get("reward_mean")
        track = "rule-track " if "reward_std" in self._judged else ""
        msg = (f"{track}reward variance collapsed for {self._counters['reward']} steps "
               f"({self._reward_fields(rec)}, {self._name('reward_mean')}={_fmt(mean)}): no learning signal")
        return _Hit("warning", msg, self._name(key), self._window(key, c.reward_collapse_patience),
                    {"reward_std_min": c.reward_std_min, "zero_var_frac_max": c.zero_var_frac_max,
                     "judged_on": self._name(key)})

    def _trailing_reward(self) -> Optional[float]:
        """Mean of the last ``reward_drop_window`` (judged) rewards, None before there are that many."""
        return self._trailing_mean("reward_mean")

    def _trailing_mean(self, key: str) -> Optional[float]:
        """Mean of the last ``reward_drop_window`` values of ``key``, None before there are that many."""
        n = self.cfg.reward_drop_window
        recent = [v for _, v in list(self._hist[key])[-n:]]
        return statistics.fmean(recent) if len(recent) == n else None

    def _second_signal(self, it: int) -> tuple[bool, str]:
        """(whether reward_drop's second signal agrees, what it read); agrees when there is none to read."""
        c = self.cfg
        if c.reward_drop_confirm == "eval":
            now, best, at = self.latest_eval, self.best_healthy_eval, self.latest_eval_iteration
            if now is None or not at or it - at >= c.reward_drop_eval_max_age or best is None or best <= 0:
                return True, ""  # no evaluation to wait for, or too old to hold the alarm back: the reward alone
            line = (1.0 - c.reward_drop_eval_fraction) * best
            return now < line, (f"; the latest evaluation's {c.reward_drop_eval_field} {now:.4g} is below "
                                f"{1 - c.reward_drop_eval_fraction:g} x its best healthy value {best:.4g}")
        if c.reward_drop_confirm == "diversity":
            now, ref = self._diversity, self.diversity_at_best
            if now is None or ref is None or ref <= 0:
                return True, ""
            return abs(now - ref) >= c.reward_drop_diversity_change * ref, (
                f"; the answer diversity moved from {ref:.3g} to {now:.3g}")
        return True, ""

    def _rule_reward_drop(self, rec: Mapping, it: int) -> Optional[_Hit]:
        c, best, now = self.cfg, self.best_healthy_reward_trailing, self._trailing
        if c.reward_drop_fraction is None or now is None or best is None or best <= 0 or best < c.reward_drop_min_best:
            self._counters["reward_drop"] = 0
            return None
        line = (1.0 - c.reward_drop_fraction) * best
        self._counters["reward_drop"] = self._counters["reward_drop"] + 1 if now < line else 0
        if self._counters["reward_drop"] < c.reward_drop_patience:
            return None
        agrees, second = self._second_signal(it)
        if not agrees:  # still not a healthy iteration (the counter runs); the alarm waits for the signal
            return None
        key, n = self._name("reward_mean"), c.reward_drop_window
        what = key if n == 1 else f"{key} mean over the last {n} iterations"
        msg = (f"{what} {now:.4g} below {1 - c.reward_drop_fraction:g} x its best healthy value {best:.4g} "
               f"for {self._counters['reward_drop']} iterations{second}: the reward is falling")
        return _Hit("critical", msg, key, self._window("reward_mean", max(n, c.reward_drop_patience)),
                    {"best_healthy_reward": best, "line": line, "fraction": c.reward_drop_fraction, "window": n})


def run_detector(records, cfg: Any = None) -> list[Alert]:
    """Run a fresh detector per run_id over ``records`` (kind ``train`` only); return all alerts."""
    detectors: dict[str, CollapseDetector] = {}
    out: list[Alert] = []
    for rec in records:
        if rec.get("kind", "train") != "train":
            continue
        run = rec.get("run_id", "default")
        det = detectors.get(run)
        if det is None:
            det = detectors[run] = CollapseDetector(cfg, run_id=run)
        out.extend(det.update(rec))
    return out
