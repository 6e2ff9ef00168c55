"""Metric record schema shared by the client, the sidecar and the offline tools.

A record is one flat JSON object per iteration. Standard fields are listed in
:data:`RECORD_FIELDS`; any other numeric key is accepted and stored too.
Envelope keys added by the client: ``run_id``, ``attempt`` (bumped on rollback),
``kind`` (``train`` unless told otherwise) and ``time`` (wall clock, seconds).
The idempotency key is ``(run_id, attempt, iteration, kind)``.

Stdlib only: the sidecar imports this module.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

RECORD_FIELDS: dict[str, str] = {
    "iteration": "RL iteration (int >= 0); part of the idempotency key",
    "entropy": "mean exact token entropy of the sampled responses under the current policy (nats)",
    "entropy_frac": "entropy as a fraction of ln|V|",
    "kl_old_new": "KL(pi_old || pi_new) over the iteration's updates (policy drift)",
    "kl_estimator": "name of the KL estimator of kl_old_new (e.g. k1, k2, k3, exact); of kl_ref too when "
                    "kl_ref_estimator is absent",
    "kl_ref": "KL(pi_theta || pi_ref) over the iteration's updates (when a reference model exists)",
    "kl_ref_estimator": "name of the estimator of kl_ref (loss.kl_estimator; sent with kl_ref)",
    "mismatch_kl": ("sampler vs trainer log-prob mismatch, KL(sampler || trainer) (kept separate from policy "
                    "drift); null for a batch sampled by older weights (rollout.max_staleness >= 1), whose gap "
                    "is staleness: kl_behaviour"),
    "repetition_rate": "repeated 3-/4-gram share of the sampled responses",
    "longest_repeat": "longest repeated run in any sampled response (tokens)",
    "language_consistency": "share of letters in the dominant expected script",
    "perplexity": "perplexity of the sampled responses under the current policy",
    "reward_mean": "mean reward of the iteration's samples",
    "reward_std": "reward standard deviation",
    "reward_agreement": "agreement of the reward with labelled data (from the reward layer)",
    "grad_norm": "global gradient norm (before clipping)",
    "tau": "DPCC ratio threshold tau_t of the last step (loss.name dpcc only: a baseline's bound is its fixed clip range)",
    "lr": "current learning rate",
    "lr_factor": "multiplier of the scheduled LR at the last step: drift-aware factor x monitor advice",
    "clip_frac": "fraction of tokens whose ratio was clipped",
    "sample_utilization": "fraction of samples that contributed gradient",
    "zero_var_frac": "fraction of GRPO groups with zero reward variance",
    "steps_taken": "optimizer steps applied so far in the run (cumulative)",
    "steps_skipped": "optimizer steps skipped so far in the run (non-finite logits or grads, fp16 overflow; cumulative)",
    "reward_base_mean": "rule-track (base) reward mean",
    "reward_base_std": "rule-track reward standard deviation (the detector judges reward collapse on it)",
    "zero_var_frac_base": "fraction of groups whose rule-track rewards are all equal",
    "optimizer_steps": "optimizer steps of the iteration (taken or skipped); with 1, kl_step_max is the after-step reading and the KL thresholds scale by monitor.kl_one_step_factor",
    "kl_step_max": "largest per-step KL(pi_old || pi_new) of the iteration, measured in each step's forward, or with one step per iteration after it (monitor.step_kl_probe); the detector's kl_drift reads it",
    "kl_probe": "DPCC drift probe: KL(pi_old || pi_new) after the iteration's last step (loss.dpcc.drift_probe); the controller reads it, the detector does not",
    "ds_rounds": "dynamic sampling: sampling rounds this iteration",
    "ds_sampled_groups": "dynamic sampling: groups sampled over all rounds, all DP ranks",
    "ds_kept_groups": "dynamic sampling: informative groups kept (rule rewards differ), all DP ranks",
    "ds_dropped_groups": "dynamic sampling: zero-variance groups dropped, all DP ranks",
    "ds_padded_groups": "dynamic sampling: dropped groups reused to fill a batch left short after the last round",
    "reward_mean_sampled": "dynamic sampling: mean reward over everything sampled (reward_mean is the kept batch's)",
    "steps_nonfinite": "steps of this iteration whose logits were non-finite (their metrics are left out of the record)",
}

ENVELOPE_KEYS = ("run_id", "attempt", "kind", "time")
STRING_FIELDS = {"kl_estimator", "kl_ref_estimator", "run_id", "kind"}

MAX_KEYS = 256
MAX_KEY_LEN = 64
MAX_STR_LEN = 256
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.\-/:#@+]{1,128}$")


class RecordError(ValueError):
    """A record does not match the schema."""


def normalize_record(raw: Any) -> dict:
    """Validate one decoded record and fill envelope defaults; raise RecordError."""
    if not isinstance(raw, dict):
        raise RecordError(f"record must be a JSON object, got {type(raw).__name__}")
    if len(raw) > MAX_KEYS:
        raise RecordError(f"record has {len(raw)} keys (max {MAX_KEYS})")
    it = raw.get("iteration")
    if isinstance(it, float) and math.isfinite(it) and it.is_integer():
        it = int(it)
    if not isinstance(it, int) or isinstance(it, bool) or it < 0:
        raise RecordError(f"iteration must be an int >= 0, got {raw.get('iteration')!r}")
    out: dict = {}
    for key, value in raw.items():
        if not isinstance(key, str) or len(key) > MAX_KEY_LEN or not _KEY_RE.match(key):
            raise RecordError(f"invalid field name {key!r}")
        if value is None or isinstance(value, (int, float)):
            out[key] = value
        elif isinstance(value, str):
            if len(value) > MAX_STR_LEN:
                raise RecordError(f"field {key} is a string longer than {MAX_STR_LEN}")
            out[key] = value
        else:
            raise RecordError(f"field {key} must be a number, string or null, got {type(value).__name__}")
    out["iteration"] = it
    run_id = out.get("run_id", "default")
    if not isinstance(run_id, str) or not _ID_RE.match(run_id):
        raise RecordError(f"run_id must match {_ID_RE.pattern}, got {run_id!r}")
    kind = out.get("kind", "train")
    if not isinstance(kind, str) or not _ID_RE.match(kind):
        raise RecordError(f"kind must match {_ID_RE.pattern}, got {kind!r}")
    attempt = out.get("attempt", 0)
    if isinstance(attempt, float) and attempt.is_integer():
        attempt = int(attempt)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise RecordError(f"attempt must be an int >= 0, got {attempt!r}")
    out["run_id"], out["kind"], out["attempt"] = run_id, kind, attempt
    t = out.get("time")
    if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool)):
        raise RecordError("time must be a number")
    return out


def numeric_fields(record: Mapping) -> dict[str, float]:
    """Numeric metric values of a record (envelope and iteration excluded; bools as 0/1)."""
    out = {}
    for key, value in record.items():
        if key in ENVELOPE_KEYS or key == "iteration":
            continue
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def sanitize(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become the strings "nan", "inf", "-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj


def dumps_strict(obj: Any) -> str:
    """Standard JSON (no NaN tokens) for sinks other tools read."""
    return json.dumps(sanitize(obj), separators=(",", ":"), sort_keys=False)
