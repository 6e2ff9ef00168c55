"""monitor section of the config tree: metrics sidecar, trainer-side client,
collapse detector, alert sinks and the control channel.

Relative paths (``db_path``, ``spool_path``, ``alerts_jsonl``, ``tensorboard_dir``)
are resolved against ``train.output_dir`` by
:func:`dpcc_megatron.monitor.launcher.resolve_paths`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .base import check

#: reward_drop's second signals (monitor.reward_drop_confirm): None is the reward alone.
REWARD_DROP_CONFIRMS = (None, "eval", "diversity")
#: Evaluation fields the "eval" confirmation can read (the trainer's eval metrics, prefixed eval_).
REWARD_DROP_EVAL_FIELDS = ("eval_reward_greedy", "eval_reward_sampled")


ACT_ON = ("all", "confirmed", "none")
CONFIRMED_ACTIONS = ("rollback", "checkpoint_and_pause")
"""The advice a confirmed collapse gives (monitor/alerts.py ControlPolicy); reduce_lr comes from single alerts."""


def parse_hostport(value: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; ``[::1]:80`` style IPv6 is accepted."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host, _, port_s = value.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"expected HOST:PORT with a host, got {value!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port of {value!r} is not an integer") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port of {value!r} must be in [0, 65535]")
    return host, port


@dataclass
class MonitorConfig:
    """Metrics sidecar, trainer-side client and collapse detector.

    Read by: dpcc_megatron/monitor/, dpcc_megatron/train/monitor_exchange.py, dpcc_megatron/train/checkpoints.py,
    dpcc_megatron/train/control.py, dpcc_megatron/train/trainer.py, dpcc_megatron/commands/monitor.py.
    """

    # --- process, transport, storage -------------------------------------------------
    enabled: bool = True
    """Send metric records to the sidecar. Sending never blocks; the trainer waits at most
    `advice_wait_s` per iteration for the advice, and not at all once the sidecar counts as down."""
    listen: str = "127.0.0.1:0"
    """Sidecar bind address HOST:PORT; port 0 picks a free port. Loopback by default."""
    address: Optional[str] = None
    """HOST:PORT the trainer's client connects to; None uses the sidecar the launcher started."""
    token: Optional[str] = None
    """Shared auth token; None reads env DPCC_MONITOR_TOKEN (the launcher generates one when unset)."""
    run_id: Optional[str] = None
    """Run identity in the sidecar's database; None derives it from train.output_dir."""
    db_path: str = "monitor/monitor.sqlite"
    """SQLite database of every record, alert and control advice."""
    spool_path: Optional[str] = None
    """Client-side JSONL spool used while the sidecar is down; None: monitor/spool-<run_id>.jsonl."""
    tensorboard_dir: Optional[str] = "monitor/tb"
    """TensorBoard event directory written by the sidecar; None disables."""
    queue_size: int = 4096
    """Bounded client queue (records); when full, records are dropped and counted."""
    max_message_bytes: int = 1 << 20
    """Largest accepted HTTP body; larger messages are rejected (413) and counted."""
    batch_max_records: int = 256
    """Records per ingest request."""
    flush_interval_s: float = 0.05
    """Client background thread wakes at least this often to ship queued records."""
    control_poll_interval_s: float = 1.0
    """Client polls the control channel at least this often (in the background)."""
    request_timeout_s: float = 2.0
    """Client-side HTTP timeout; a slow sidecar makes the client spool, never the trainer wait."""
    retry_max_backoff_s: float = 2.0
    """Cap of the client's exponential reconnect backoff while the sidecar is down."""
    spool_max_bytes: int = 256 << 20
    """Spool file cap; records beyond it are dropped and counted."""

    # --- collapse detector --------------------------------------------------------------
    entropy_band: Optional[tuple[float, float]] = None
    """Normal token-entropy band [low, high] in nats, e.g. [3.5, 5.0]; None calibrates it."""
    entropy_band_relative: Optional[tuple[float, float]] = (0.5, 1.6)
    """When `entropy_band` is None: the band as [low, high] multiples of the first record's entropy (the
    starting policy's, measured before its first update), so a collapse in the first iterations is judged
    against it; None calibrates the band from healthy steps instead."""
    entropy_calibration_steps: int = 20
    """K: healthy steps used to calibrate the band when `entropy_band` and `entropy_band_relative` are None."""
    entropy_band_sigmas: float = 4.0
    """Calibrated band half-width in standard deviations of the K healthy steps..."""
    entropy_band_min_halfwidth: float = 0.15
    """...but at least this fraction of their mean entropy."""
    entropy_jump: float = 0.5
    """high_entropy also fires when entropy rises by this fraction of the band centre..."""
    entropy_jump_window: int = 3
    """...within this many steps."""
    low_entropy_patience: int = 3
    """Consecutive steps below the band before low_entropy fires on entropy alone."""
    entropy_floor_ratio: float = 0.4
    """Until the band is calibrated, entropy below this fraction of the mean healthy entropy so far counts
    as below the band (so a collapse in the first K steps is seen); 0 disables."""
    low_entropy_reward_drop: Optional[float] = 0.1
    """Entropy below the band is critical (a template collapse, confirmable) when the learning signal is
    gone too (reward_collapse's condition) and reward_mean is at least this far below its best healthy
    value; a mastered task (reward at its best) stays a warning. None: entropy alone is always a warning."""
    mastered_reward_gain: Optional[float] = 0.05
    """Entropy below the band is judged against the reward: when the (rule-track) reward's mean over the last
    3 iterations is at least this much above its mean over the healthy iterations, the task is being mastered
    (no alert, the steps stay healthy); otherwise the policy turned deterministic without learning (critical,
    confirmable). None: entropy below the band is a warning unless `low_entropy_reward_drop` makes it a
    template collapse."""
    repetition_threshold: float = 0.5
    """low_entropy fires when repetition_rate (repeated 3/4-gram share) is at or above this."""
    longest_repeat_threshold: int = 0
    """low_entropy also fires when longest_repeat (tokens) reaches this; 0 disables."""
    kl_threshold: float = 0.8
    """kl_drift fires when kl_old_new exceeds this..."""
    kl_window: int = 3
    """...for this many consecutive batches."""
    kl_critical_threshold: Optional[float] = 0.5
    """kl_drift is critical (confirmable like any critical) when one iteration's KL (the largest per-step KL,
    `kl_step_max`, when sent) exceeds this: a runaway update. None disables."""
    kl_sustained_threshold: Optional[float] = 0.1
    """kl_drift is also critical when the per-step KL (`kl_step_max`, when sent) stays above this for
    `kl_sustained_window` consecutive iterations: a step size that drifts (an LR climbing, a schedule
    gone wrong) before the reward falls. None disables."""
    kl_sustained_window: int = 2
    """Consecutive iterations the per-step KL must stay above `kl_sustained_threshold`."""
    step_kl_probe: bool = True
    """With one optimizer step per iteration every in-step KL is the fresh step's (~0 by construction), so
    the trainer measures that step's KL(pi_old || pi_new) after it, with one forward-only micro-batch of
    the batch, and records it as `kl_step_max` for the KL rules (any loss; DPCC's drift probe, when on,
    is the same pass). False: no extra pass, and the KL rules have no reading in that setting."""
    kl_one_step_factor: float = 3.0
    """With one optimizer step in an iteration (the record's `optimizer_steps` is 1), `kl_step_max` is the
    after-step reading of `step_kl_probe`, taken on samples the step trained on: a larger quantity than the
    in-step KL of a later step, which is read on samples that step has not trained on. The KL thresholds
    (`kl_threshold`, `kl_critical_threshold`, `kl_sustained_threshold`) are multiplied by this factor for
    such iterations. 1: the same thresholds for both readings."""
    kl_ref_threshold: Optional[float] = 1.0
    """kl_drift warning when the KL to the reference (`kl_ref`, sent only while a reference model exists:
    `loss.ref_kl_coef` > 0) exceeds this for `kl_window` consecutive iterations. 1.0: the smallest value
    tried that kept these warnings under 1 per 100 healthy iterations of the development runs with a
    reference (benchmarks/monitor/RESULTS.md#eighth-calibration). None disables."""
    kl_ref_critical_threshold: Optional[float] = None
    """kl_drift is critical when one iteration's KL to the reference (`kl_ref`) exceeds this: the policy
    has drifted far from the model the penalty holds it to. Off by default: no value tried (0.5-4) raised
    the detector's J on the development runs with a reference, since healthy runs drift as far
    (benchmarks/monitor/RESULTS.md#eighth-calibration). Runs without a reference send no `kl_ref`. None disables."""
    mismatch_kl_threshold: Optional[float] = None
    """sampler_mismatch warning when mismatch_kl exceeds this (same window); None disables."""
    grad_spike_factor: float = 20.0
    """grad_spike fires when grad_norm exceeds this multiple of the recent median..."""
    grad_spike_window: int = 20
    """...of this many previous steps..."""
    grad_spike_min_history: int = 5
    """...once at least this many are known."""
    reward_std_min: float = 1e-3
    """reward_collapse: reward_std below this counts as a collapsed step..."""
    zero_var_frac_max: float = 0.95
    """...as does a zero-variance group fraction at or above this..."""
    reward_collapse_patience: int = 5
    """...for this many consecutive steps."""
    reward_drop_fraction: Optional[float] = 0.5
    """reward_drop is critical (confirmable) when the mean of the last `reward_drop_window` (rule-track)
    rewards has been below (1 - this) x its best value at a healthy iteration for `reward_drop_patience`
    consecutive iterations, while that best is positive (a fraction of a zero or negative best means
    nothing). A reactive rule: it reads the reward's level, the quantity a collapse is defined by. None
    disables."""
    reward_drop_patience: int = 1
    """Consecutive iterations the reward must stay below the reward_drop line."""
    reward_drop_window: int = 3
    """Iterations in the trailing reward mean that reward_drop reads (1: each iteration's own reward)."""
    reward_drop_min_best: float = 0.05
    """reward_drop acts only once the best healthy trailing reward reaches this (in the reward's units; a
    pass rate here): half of a best of a few percent is within the sampling noise of one iteration's
    mean, and a run that has barely started to learn has nothing to roll back to."""
    reward_drop_confirm: Optional[str] = "eval"
    """A second signal reward_drop waits for before it raises its critical (its iterations below the line
    are not healthy either way). None: the reward alone. "eval": the latest held-out evaluation's
    `reward_drop_eval_field` (eval.interval; the trainer puts each evaluation into the next iteration's
    record) is below (1 - `reward_drop_eval_fraction`) x its best at a healthy iteration, so the rule
    waits for the next evaluation, but holds the alarm back for at most `reward_drop_eval_max_age`
    iterations after an evaluation. "diversity": the trailing mean of the in-group answer diversity
    (answer_distinct_frac) has moved by at least `reward_drop_diversity_change` x its value at the
    iteration that set the best healthy reward. Without the field the reward alone decides; for "eval"
    also in a run that evaluates only at its start (eval.interval 0, the default)."""
    reward_drop_eval_field: str = "eval_reward_greedy"
    """The evaluation field the "eval" confirmation reads: eval_reward_greedy (greedy, no sampling noise)
    or eval_reward_sampled (eval.samples answers per prompt from a generator seeded the same each time)."""
    reward_drop_eval_fraction: float = 0.3
    """The "eval" confirmation: how far below its best healthy value the evaluation reward must be."""
    reward_drop_eval_max_age: int = 10
    """The "eval" confirmation: an evaluation this many iterations old or older holds nothing back (the
    reward alone decides), so with a long eval.interval a stale evaluation delays a collapse alarm by at
    most this. A bound chosen without data: the seventh calibration's readings (evaluations every 1 and
    every 5 iterations) are the same for any value from 5 up."""
    reward_drop_diversity_change: float = 0.2
    """The "diversity" confirmation: the relative change of the answer diversity that counts."""
    collapse_confirm_steps: int = 1
    """A critical alert whose condition holds this many consecutive steps is a confirmed collapse."""
    alert_cooldown: int = 10
    """A rule that stays triggered re-alerts only after this many iterations."""

    # --- alert sinks ----------------------------------------------------------------------
    alerts_jsonl: Optional[str] = "monitor/alerts.jsonl"
    """Alerts appended here as JSON lines; None disables (alerts always go to the log)."""
    webhook_url: Optional[str] = None
    """HTTP(S) URL that receives each alert as a JSON POST; failures are counted, never block."""
    webhook_timeout_s: float = 2.0
    """Timeout of one webhook POST."""

    # --- control channel --------------------------------------------------------------------
    control_enabled: Optional[bool] = None
    """Derive control advice from alerts and act on it. None (default): follow `enabled`, so a run with
    the monitor off gets no advice; true/false: on/off explicitly (true with `enabled: false` acts on the
    rank-0 local detector's advice)."""
    act_on: str = "all"
    """Which advice the trainer acts on (with control active; the sidecar and the local detector advise
    either way, and every alert still reaches the log, the JSONL file and the webhook). "all": reduce_lr,
    rollback and checkpoint_and_pause. "confirmed": only a confirmed collapse's rollback or
    checkpoint_and_pause; reduce_lr advice is logged, not applied. "none": advise only; each advice is
    logged as not acted on, and the run neither rolls back nor keeps checkpoints for a rollback.
    The shipped 7B/70B/123B examples set "none": the thresholds were calibrated on 2-4-layer CPU models
    (docs/monitor.md, "Acting at scale")."""
    advice_wait_s: float = 10.0
    """The trainer waits up to this long, after sending iteration i's record, for the sidecar to
    acknowledge it, so advice about iteration i is always applied before iteration i+1 (runs are
    reproducible). On time-out it logs the fallback, counts it and uses the rank-0 local detector's
    advice for that iteration. 0 never waits (advice then lands whenever it arrives)."""
    reduce_lr_factor: float = 0.5
    """kl_drift / high_entropy advise multiplying the LR by this factor."""
    lr_recovery_iterations: int = 20
    """After this many consecutive iterations without new reduce_lr advice the LR scale recovers one step
    (divided by reduce_lr_factor, at most 1); 0: cuts are permanent."""
    sidecar_down_after: int = 3
    """After this many consecutive unacknowledged iterations the sidecar counts as down and the local
    detector gives the advice without waiting, until the sidecar answers again (logged both ways)."""
    rollback_on_collapse: bool = True
    """A confirmed collapse advises rolling back to the last healthy iteration (to the newest kept
    checkpoint at or before it: the trainer keeps that one beyond `checkpoint.keep_last`). Needs
    `checkpoint.dir`; without a checkpoint to go back to the advice becomes checkpoint_and_pause."""
    rollback_before_evidence: bool = True
    """Roll back to before the first iteration of the confirmed alert's evidence (its window), when that
    is earlier than the last healthy iteration: a trailing rule (reward_drop's 3-iteration mean) confirms
    a collapse after the decline began, so a rollback to the last healthy iteration lands inside it and
    alerts again at once. Checkpoint retention keeps a checkpoint that far back. false: the last healthy
    iteration."""
    rollback_to_start: bool = True
    """A confirmed collapse before any healthy iteration (a first update that runs away) rolls back to
    the weights the run started from, which the trainer then saves as iteration 0; false: pause."""
    max_rollbacks: int = 3
    """After this many rollbacks in one run, a further confirmed collapse pauses instead: each rollback
    halves the LR scale, and a run that keeps collapsing needs a person, not a loop."""
    pause_on_collapse: bool = True
    """A confirmed collapse without rollback (disabled or no healthy iteration) advises checkpoint_and_pause."""

    def acts_on(self, action: str) -> bool:
        """Whether the trainer carries out ``action`` (an advice's action) under ``act_on``."""
        if not self.control_active or action == "none" or self.act_on == "none":
            return False
        return self.act_on == "all" or action in CONFIRMED_ACTIONS

    @property
    def control_active(self) -> bool:
        """Whether control advice is derived and acted on (control_enabled, else enabled)."""
        return self.enabled if self.control_enabled is None else self.control_enabled

    def validate(self) -> None:
        for name in ("listen", "address"):
            value = getattr(self, name)
            if value is None and name == "address":
                continue
            try:
                parse_hostport(value)
            except ValueError as e:
                check(False, name, f"must be HOST:PORT, got {value!r} ({e})")
        if self.token is not None:
            check(len(self.token) >= 8, "token", f"must be at least 8 characters, got {len(self.token)}")
        check(bool(self.db_path), "db_path", "must not be empty")
        check(self.queue_size >= 1, "queue_size", f"must be >= 1, got {self.queue_size}")
        check(self.max_message_bytes >= 1024, "max_message_bytes", f"must be >= 1024, got {self.max_message_bytes}")
        check(self.batch_max_records >= 1, "batch_max_records", f"must be >= 1, got {self.batch_max_records}")
        check(self.flush_interval_s > 0, "flush_interval_s", f"must be > 0, got {self.flush_interval_s}")
        check(self.control_poll_interval_s > 0, "control_poll_interval_s",
              f"must be > 0, got {self.control_poll_interval_s}")
        check(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}")
        check(self.act_on in ACT_ON, "act_on", f"must be one of {', '.join(ACT_ON)}, got {self.act_on!r}")
        check(self.advice_wait_s >= 0, "advice_wait_s", f"must be >= 0, got {self.advice_wait_s}")
        check(self.lr_recovery_iterations >= 0, "lr_recovery_iterations",
              f"must be >= 0, got {self.lr_recovery_iterations}")
        check(self.max_rollbacks >= 1, "max_rollbacks",
              f"must be >= 1, got {self.max_rollbacks} (monitor.rollback_on_collapse: false turns rollback off)")
        check(self.sidecar_down_after >= 1, "sidecar_down_after", f"must be >= 1, got {self.sidecar_down_after}")
        check(self.retry_max_backoff_s > 0, "retry_max_backoff_s", f"must be > 0, got {self.retry_max_backoff_s}")
        check(self.spool_max_bytes >= 0, "spool_max_bytes", f"must be >= 0, got {self.spool_max_bytes}")
        if self.entropy_band is not None:
            lo, hi = self.entropy_band
            check(math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < hi, "entropy_band",
                  f"must be [low, high] with 0 <= low < high, got {list(self.entropy_band)}")
        if self.entropy_band_relative is not None:
            lo, hi = self.entropy_band_relative
            check(math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < 1 < hi, "entropy_band_relative",
                  f"must be [low, high] with 0 <= low < 1 < high, got {list(self.entropy_band_relative)}")
        check(self.entropy_calibration_steps >= 2, "entropy_calibration_steps",
              f"must be >= 2, got {self.entropy_calibration_steps}")
        check(self.entropy_band_sigmas > 0, "entropy_band_sigmas", f"must be > 0, got {self.entropy_band_sigmas}")
        check(self.entropy_band_min_halfwidth >= 0, "entropy_band_min_halfwidth",
              f"must be >= 0, got {self.entropy_band_min_halfwidth}")
        check(self.entropy_jump > 0, "entropy_jump", f"must be > 0, got {self.entropy_jump}")
        check(self.entropy_jump_window >= 2, "entropy_jump_window", f"must be >= 2, got {self.entropy_jump_window}")
        check(self.low_entropy_patience >= 1, "low_entropy_patience", f"must be >= 1, got {self.low_entropy_patience}")
        check(0 <= self.entropy_floor_ratio < 1, "entropy_floor_ratio",
              f"must be in [0, 1), got {self.entropy_floor_ratio}")
        check(self.low_entropy_reward_drop is None or self.low_entropy_reward_drop >= 0, "low_entropy_reward_drop",
              f"must be >= 0 or null, got {self.low_entropy_reward_drop}")
        check(self.mastered_reward_gain is None or self.mastered_reward_gain >= 0, "mastered_reward_gain",
              f"must be >= 0 or null, got {self.mastered_reward_gain}")
        check(0 < self.repetition_threshold <= 1, "repetition_threshold",
              f"must be in (0, 1], got {self.repetition_threshold}")
        check(self.longest_repeat_threshold >= 0, "longest_repeat_threshold",
              f"must be >= 0, got {self.longest_repeat_threshold}")
        check(self.kl_threshold > 0, "kl_threshold", f"must be > 0, got {self.kl_threshold}")
        check(self.kl_window >= 1, "kl_window", f"must be >= 1, got {self.kl_window}")
        check(self.kl_one_step_factor >= 1, "kl_one_step_factor", f"must be >= 1, got {self.kl_one_step_factor}")
        check(self.kl_sustained_window >= 1, "kl_sustained_window", f"must be >= 1, got {self.kl_sustained_window}")
        for name in ("kl_ref_threshold", "kl_ref_critical_threshold", "mismatch_kl_threshold", "kl_critical_threshold",
                     "kl_sustained_threshold"):
            value = getattr(self, name)
            check(value is None or value > 0, name, f"must be > 0 or null, got {value}")
        check(self.grad_spike_factor > 1, "grad_spike_factor", f"must be > 1, got {self.grad_spike_factor}")
        check(self.grad_spike_window >= 1, "grad_spike_window", f"must be >= 1, got {self.grad_spike_window}")
        check(1 <= self.grad_spike_min_history <= self.grad_spike_window, "grad_spike_min_history",
              f"must be in [1, grad_spike_window={self.grad_spike_window}], got {self.grad_spike_min_history}")
        check(self.reward_std_min >= 0, "reward_std_min", f"must be >= 0, got {self.reward_std_min}")
        check(0 < self.zero_var_frac_max <= 1, "zero_var_frac_max", f"must be in (0, 1], got {self.zero_var_frac_max}")
        check(self.reward_collapse_patience >= 1, "reward_collapse_patience",
              f"must be >= 1, got {self.reward_collapse_patience}")
        check(self.reward_drop_fraction is None or 0 < self.reward_drop_fraction < 1, "reward_drop_fraction",
              f"must be in (0, 1) or null, got {self.reward_drop_fraction}")
        check(self.reward_drop_patience >= 1, "reward_drop_patience", f"must be >= 1, got {self.reward_drop_patience}")
        check(self.reward_drop_window >= 1, "reward_drop_window", f"must be >= 1, got {self.reward_drop_window}")
        check(math.isfinite(self.reward_drop_min_best) and self.reward_drop_min_best >= 0, "reward_drop_min_best",
              f"must be a finite number >= 0, got {self.reward_drop_min_best}")
        check(self.reward_drop_confirm in REWARD_DROP_CONFIRMS, "reward_drop_confirm",
              f"must be one of {', '.join(str(x) for x in REWARD_DROP_CONFIRMS)} (null), got {self.reward_drop_confirm!r}")
        check(self.reward_drop_eval_field in REWARD_DROP_EVAL_FIELDS, "reward_drop_eval_field",
              f"must be one of {', '.join(REWARD_DROP_EVAL_FIELDS)}, got {self.reward_drop_eval_field!r}")
        check(0 < self.reward_drop_eval_fraction < 1, "reward_drop_eval_fraction",
              f"must be in (0, 1), got {self.reward_drop_eval_fraction}")
        check(self.reward_drop_eval_max_age >= 1, "reward_drop_eval_max_age",
              f"must be >= 1, got {self.reward_drop_eval_max_age}")
        check(0 < self.reward_drop_diversity_change < 1, "reward_drop_diversity_change",
              f"must be in (0, 1), got {self.reward_drop_diversity_change}")
        check(self.collapse_confirm_steps >= 1, "collapse_confirm_steps",
              f"must be >= 1, got {self.collapse_confirm_steps}")
        check(self.alert_cooldown >= 1, "alert_cooldown", f"must be >= 1, got {self.alert_cooldown}")
        if self.webhook_url is not None:
            check(self.webhook_url.startswith(("http://", "https://")), "webhook_url",
                  f"must be an http:// or https:// URL, got {self.webhook_url!r}")
        check(self.webhook_timeout_s > 0, "webhook_timeout_s", f"must be > 0, got {self.webhook_timeout_s}")
        check(0 < self.reduce_lr_factor < 1, "reduce_lr_factor", f"must be in (0, 1), got {self.reduce_lr_factor}")
