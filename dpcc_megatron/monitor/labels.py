"""The labelling rule of the monitor's labelled set: a written rule on the reward and entropy
curves of a stream, applied to every stream alike (no stream is labelled by hand).

Revised three times, each time before the held-out part it was then scored on was trained:
1. "m stays below half its best to the end" became "m is below half its best and the rest of the
   run averages below it", because a single lucky batch of the 8-prompt reward after an obvious
   fall undid the first form.
2. The entropy clause was added (the collapse is read on the reward *and* the entropy curve): on
   the first held-out part, runs whose entropy had left the band for good with the reward no better
   than at the start (a policy turned near-deterministic or random without learning) were labelled
   healthy because their 20-iteration reward never quite halved.
3. The ``degraded`` label was added: runs at too-large LRs whose reward sank and stayed low without
   quite halving (a policy drifting away, KL running off, no learning) were labelled healthy, so
   a critical alert on them counted as a false alarm. Such a run is neither a collapse by the rule
   nor healthy; the detector is scored on it separately.

- **Reward** r_t: the rule-track reward ``reward_base_mean`` (``reward_mean`` when absent);
  m_t its trailing mean over 3 iterations.
- **Collapse** when the reward halves for good: there is an iteration h, with at least 5
  iterations from h to the end, with m_h < 0.5 x B_h (B_h: the best m up to h) and whose rewards from h to
  the end also average below 0.5 x B_h
  (:func:`dpcc_megatron.monitor.evaluate.half_reward_iteration`, the same function the lead time
  of ``monitor evaluate`` is measured to); or the entropy is outside the band for
  ``ENTROPY_RUN`` consecutive iterations while the rule reward over them averages no higher than
  the warm-started policy's r_0 (:func:`entropy_collapse`); or the trainer stopped on non-finite
  steps, or the stream carries a non-finite entropy or reward.
- **Degraded** when it did not collapse, but its final held-out greedy reward (the trainer's
  ``reward_after``) is below the warm-started policy's (``reward_before``): it ended worse than it
  started, by the stability benchmark's "ended below start" measure. The greedy evaluation reads
  fixed held-out prompts, so it is not the 8-prompt batch noise of the training reward (that noise
  labelled 6 of 16 safe-LR GRPO runs of the development part degraded when the last 5 iterations'
  training reward was compared with the first iteration's).
- Otherwise **healthy**: a run that masters the task with a falling entropy and a rising reward is
  healthy, and so is one that stays where it started.
- **onset** = the earlier of h and the entropy clause's first iteration (for a non-finite stop: the
  first non-finite iteration, else the last iteration).
- **direction**: the entropy band is [0.4, 2.0] x the warm-started policy's entropy e_0 (the first
  record's: it is measured before any RL update; ``benchmarks/stability/measures.py``'s band).
  ``high`` when the mean entropy from the onset on is above e_0, else ``low``.
- **entropy_exit**: the first iteration from which entropy is outside the band for 2 iterations
  in a row (informational: how early the entropy curve shows it).
- **instant**: the onset is within the first 3 iterations, i.e. the first RL updates destroyed
  the policy; no detector can lead such a collapse by 3 iterations.
"""
from __future__ import annotations

import math
from typing import Optional

from .evaluate import half_reward_iteration, smoothed_reward

BAND = (0.4, 2.0)
"""Normal entropy band as multiples of the warm-started policy's entropy (as benchmarks/stability)."""
INSTANT = 3
"""A collapse whose onset is before this iteration is 'instant'."""
ENTROPY_RUN = 5
"""Consecutive iterations outside the entropy band that the entropy clause needs."""


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def entropy_exit(records: list[dict], band: tuple[float, float], run: int = 2) -> Optional[int]:
    """First iteration from which entropy is outside ``band`` for ``run`` consecutive records."""
    streak = 0
    for i, r in enumerate(records):
        e = r.get("entropy")
        out = _finite(e) and not band[0] <= e <= band[1]
        streak = streak + 1 if out else 0
        if streak >= run:
            return int(records[i - run + 1]["iteration"])
    return None


def _reward(r: dict):
    v = r.get("reward_base_mean", r.get("reward_mean"))
    return v if _finite(v) else None


def entropy_collapse(records: list[dict], band: tuple[float, float], run: int = ENTROPY_RUN) -> Optional[int]:
    """First iteration of ``run`` consecutive records with the entropy outside ``band`` whose rule reward
    averages at most the first record's (the warm-started policy's): the policy turned deterministic (or
    random) without learning. None when there is no such stretch."""
    r0 = _reward(records[0]) if records else None
    if r0 is None:
        return None
    streak = 0
    for i, r in enumerate(records):
        e = r.get("entropy")
        streak = streak + 1 if _finite(e) and not band[0] <= e <= band[1] else 0
        if streak >= run:
            seg = [v for v in (_reward(x) for x in records[i - run + 1: i + 1]) if v is not None]
            if seg and sum(seg) / len(seg) <= r0:
                return int(records[i - run + 1]["iteration"])
    return None


def label_stream(records: list[dict], stop_reason: str = "", greedy: Optional[tuple] = None) -> dict:
    """``{"label", "onset", "direction", "halves", "entropy_collapse", "entropy_exit", "instant",
    "best_reward", "final_reward", "entropy_band"}`` of one stream (see the module docstring).
    ``greedy``: the run's held-out greedy reward (before, after) RL; without it no stream is degraded."""
    e0 = records[0].get("entropy") if records else None
    band = (BAND[0] * e0, BAND[1] * e0) if _finite(e0) and e0 > 0 else None
    m = [v for v in smoothed_reward(records) if v is not None]
    out = {"halves": half_reward_iteration(records), "entropy_exit": entropy_exit(records, band) if band else None,
           "best_reward": round(max(m), 4) if m else None, "final_reward": round(m[-1], 4) if m else None,
           "entropy_band": [round(band[0], 4), round(band[1], 4)] if band else None}
    bad = [int(r["iteration"]) for r in records
           if any(k in r and not _finite(r[k]) for k in ("entropy", "reward_base_mean", "reward_mean"))]
    non_finite = "non-finite" in stop_reason or bool(bad)
    out["entropy_collapse"] = entropy_collapse(records, band) if band else None
    found = [h for h in (out["halves"], out["entropy_collapse"]) if h is not None]
    if not found and not non_finite:
        below = greedy is not None and all(_finite(v) for v in greedy) and greedy[1] < greedy[0]
        return {"label": "degraded" if below else "healthy", "onset": None,
                "direction": None, "instant": False, **out}
    onset = min(found) if found else (bad[0] if bad else int(records[-1]["iteration"]))
    after = [r.get("entropy") for r in records if int(r["iteration"]) >= onset and _finite(r.get("entropy"))]
    direction = None
    if after and _finite(e0):
        direction = "high" if sum(after) / len(after) > e0 else "low"
    first = int(records[0]["iteration"])
    return {"label": "collapse", "onset": onset, "direction": direction,
            "instant": onset - first < INSTANT, **out}
