"""The dual-track reward the trainer calls: base (rules) + advanced (contrastive), combined.

    reward = DualTrackReward(cfg.reward)            # RewardConfig
    result = reward.score(samples)                  # list[Sample] -> RewardResult
    rewards = result.total                          # float32 tensor [n]
    reward.push_buffer(samples, result)             # after the update: these become "older policy"
    state = reward.state_dict()                     # weights, buffer, counters: exact resume
    reward.close()                                  # stops the sandbox pool

Per-component advantage normalisation: use ``reward.normalized_components(result)``
(each track normalised as ``normalize`` says, exactly as inside ``total``),
``result.group_index`` and ``result.weights`` instead of ``result.total``;
``result.components()`` holds the raw tracks, each in [0, 1].
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..config.reward import RewardConfig
from .base_layer import BaseLayer
from .combine import DynamicWeights, gate_by_base_spread, normalize_track
from .contrastive import OlderPolicyBuffer, advanced_scores, group_index
from .judges import Judge, build_judge
from .jsonl import read_eval_set
from .reliability import (concordance, mean_pairwise_gap, noise_ratio, within_group_pearson, within_group_variance,
                          zero_variance_fraction)
from .sample import Sample

_STATE_VERSION = 1


@dataclass
class RewardResult:
    """Rewards of one batch, in the order of the samples passed to ``score``."""

    base: torch.Tensor
    """Base (rule) track, float32 [n] in [0, 1]."""
    advanced: torch.Tensor
    """Advanced (contrastive) track, float32 [n] in [0, 1]."""
    total: torch.Tensor
    """weights['base'] * norm(base) + weights['advanced'] * norm(advanced); in [0, 1] unless normalised."""
    group_index: torch.Tensor
    """int64 [n]: contiguous group ids, in order of first appearance of each group key."""
    checker_scores: dict[str, list[Optional[float]]]
    """Checker key -> per-sample score (penalty checkers: the penalty); None where not run/applicable."""
    weights: dict[str, float]
    """Track weights used for ``total``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Reliability and health metrics (``reward/...``), all plain floats."""
    messages: list[str] = field(default_factory=list)
    """First few checker/judge error messages of this batch."""

    def components(self) -> dict[str, torch.Tensor]:
        """Raw per-track rewards, for normalising each track separately in the algo layer."""
        return {"base": self.base, "advanced": self.advanced}

    def records(self) -> list[dict]:
        """Per-sample plain dicts: base, advanced, total and the applicable checker scores."""
        out = []
        for i in range(len(self.base)):
            checkers = {k: v[i] for k, v in self.checker_scores.items() if v[i] is not None}
            out.append({"base": float(self.base[i]), "advanced": float(self.advanced[i]),
                        "total": float(self.total[i]), "checkers": checkers})
        return out


class DualTrackReward:
    """Stateful reward model: checker registry + judge + older-policy buffer + dynamic weights."""

    def __init__(self, cfg: Optional[RewardConfig] = None, judge: Optional[Judge] = None):
        self.cfg = cfg or RewardConfig()
        self.base_layer = BaseLayer(self.cfg)
        self.judge = judge if judge is not None else build_judge(self.cfg)
        self.buffer = OlderPolicyBuffer(self.cfg.buffer_size, self.cfg.buffer_per_prompt)
        self.dynamic = DynamicWeights(self.cfg)
        self.eval_set = read_eval_set(self.cfg.eval_set) if self.cfg.eval_set else None
        self.step = 0
        self.totals = {"checker_errors": 0, "checker_timeouts": 0, "judge_errors": 0}
        self._label: Optional[dict[str, Optional[float]]] = None

    # -- scoring ---------------------------------------------------------------------------------------
    def _advanced(self, samples: Sequence[Sample], base: Sequence[float], messages: list[str],
                  use_buffer: bool = True) -> tuple[torch.Tensor, int, Optional[float]]:
        """Advanced track, judge errors (0/1) and the share of groups the contrastive gate flattened.

        A failing judge scores the batch 0 (counted) instead of raising."""
        try:
            adv = advanced_scores(samples, base, self.judge, self.buffer if use_buffer else None,
                                  self.cfg.buffer_weight, self.cfg.judge.temperature)
        except Exception as e:
            if len(messages) < 20:
                messages.append(f"judge failed: {type(e).__name__}: {e}"[:500])
            return torch.zeros(len(samples), dtype=torch.float64), 1, None
        if self.cfg.contrastive_gate == "none" or not samples:
            return adv, 0, None
        adv, gated = gate_by_base_spread(adv, torch.tensor(base, dtype=torch.float64), group_index(samples)[0])
        return adv, 0, float(gated.double().mean())

    def _combine(self, base: torch.Tensor, adv: torch.Tensor, gidx: torch.Tensor,
                 weights: dict[str, float]) -> torch.Tensor:
        mode = self.cfg.normalize
        return (weights["base"] * normalize_track(base, gidx, mode)
                + weights["advanced"] * normalize_track(adv, gidx, mode))

    def normalized_components(self, result: RewardResult) -> dict[str, torch.Tensor]:
        """The two tracks after ``normalize`` (none/group/batch), before the weighted sum: what
        per-component advantages start from, so ``normalize`` acts on both paths alike."""
        mode = self.cfg.normalize
        return {name: normalize_track(x, result.group_index, mode) for name, x in result.components().items()}

    def score(self, samples: Sequence[Sample], *, update: bool = True) -> RewardResult:
        """Score a batch. ``update=False`` leaves all state (weights, step, counters) untouched; several
        such batches (dynamic sampling's rounds) advance it once with :meth:`advance`."""
        t0 = time.perf_counter()
        samples = list(samples)
        bs = self.base_layer.score(samples)
        base = torch.tensor(bs.base, dtype=torch.float64)
        messages = list(bs.messages)
        adv, judge_errors, gated_frac = self._advanced(samples, bs.base, messages)
        gidx, _ = group_index(samples)

        agreement = within_group_pearson(base, adv, gidx) if len(samples) > 1 else None
        label = self._next_label()
        noise: dict[str, Optional[float]] = {}
        if update:
            noise = self._update_state(samples, base, adv, gidx, agreement, label,
                                       (bs.errors, bs.timeouts, judge_errors))
        counts = {"checker_errors": float(bs.errors), "checker_timeouts": float(bs.timeouts),
                  "judge_errors": float(judge_errors), "unknown_task": float(bs.unknown_task),
                  "no_checker": float(bs.no_checker), "checker_skips": float(bs.skipped)}
        result = self._result(base, adv, gidx, bs.checker_scores, counts, messages)
        extra = {}
        if gated_frac is not None:
            extra["reward/contrastive_gated_group_frac"] = gated_frac
        if agreement is not None:
            extra["reward/inter_track_agreement"] = agreement
        for track in ("base", "advanced"):
            if noise.get(track) is not None:
                extra[f"reward/noise_{track}"] = noise[track]
        for track, value in (label or {}).items():
            if value is not None:
                extra[f"reward/label_agreement_{track}"] = value
        for key, values in bs.checker_scores.items():
            applied = [v for v in values if v is not None]
            if applied:
                extra[f"reward/checker/{key}"] = sum(applied) / len(applied)
        result.metrics.update(extra)
        result.metrics["reward/score_seconds"] = time.perf_counter() - t0
        return result

    def _next_label(self) -> Optional[dict[str, Optional[float]]]:
        """The label agreement the next state update uses (refreshed every ``dynamic.eval_interval`` steps)."""
        if self.eval_set is not None and (self._label is None or self.step % self.cfg.dynamic.eval_interval == 0):
            return self._label_agreement()
        return self._label

    def _update_state(self, samples, base, adv, gidx, agreement, label, counts) -> dict[str, Optional[float]]:
        """One step of the reward state: dynamic weights from this evidence, the step, the counters."""
        noise: dict[str, Optional[float]] = {}
        if self.cfg.dynamic.enabled:
            noise = self._noise(samples, base, adv, gidx)
        self.dynamic.update(noise, agreement, label)
        self._label = label
        self.step += 1
        for name, n in zip(("checker_errors", "checker_timeouts", "judge_errors"), counts):
            self.totals[name] += int(n)
        return noise

    def _result(self, base, adv, gidx, checker_scores, counts: dict, messages) -> RewardResult:
        """The result with ``total`` combined under the current weights, and its weight-dependent metrics."""
        weights = self.dynamic.weights
        total = self._combine(base, adv, gidx, weights)
        n = len(base)
        metrics = {
            "reward/base_mean": float(base.mean()) if n else 0.0,
            "reward/advanced_mean": float(adv.mean()) if n else 0.0,
            "reward/total_mean": float(total.mean()) if n else 0.0,
            "reward/var_batch": float(total.var(unbiased=False)) if n else 0.0,
            "reward/var_within_group": within_group_variance(total, gidx),
            "reward/base_var_within_group": within_group_variance(base, gidx),
            "reward/advanced_var_within_group": within_group_variance(adv, gidx),
            "reward/zero_var_group_frac": zero_variance_fraction(total, gidx),
            "reward/base_zero_var_group_frac": zero_variance_fraction(base, gidx),
            "reward/weight_base": weights["base"],
            "reward/weight_advanced": weights["advanced"],
            "reward/checker_errors": counts["checker_errors"],
            "reward/checker_timeouts": counts["checker_timeouts"],
            "reward/checker_skips": counts["checker_skips"],
            "reward/judge_errors": counts["judge_errors"],
            "reward/checker_errors_total": float(self.totals["checker_errors"]),
            "reward/checker_timeouts_total": float(self.totals["checker_timeouts"]),
            "reward/judge_errors_total": float(self.totals["judge_errors"]),
            "reward/unknown_task": counts["unknown_task"],
            "reward/no_checker": counts["no_checker"],
            "reward/buffer_size": float(len(self.buffer)),
        }
        return RewardResult(base=base.float(), advanced=adv.float(), total=total.float(), group_index=gidx,
                            checker_scores=checker_scores, weights=weights, metrics=metrics,
                            messages=messages)

    def advance(self, samples: Sequence[Sample], results: Sequence[RewardResult]) -> list[RewardResult]:
        """Advance the state once over several batches scored with ``update=False`` (one iteration's
        dynamic-sampling rounds, ``samples`` = their samples in order), then return each result re-combined
        under the new weights, so the whole iteration's totals share one set of weights.

        The evidence of the step (noise probes, inter-track agreement) is everything sampled; the counters
        advance by every round's errors. With one batch this is exactly ``score(update=True)``'s state step."""
        samples = list(samples)
        if len(samples) != sum(len(r.base) for r in results):
            raise ValueError(f"advance: {len(samples)} samples but {sum(len(r.base) for r in results)} scored")
        base = torch.cat([r.base.double() for r in results]) if results else torch.zeros(0, dtype=torch.float64)
        adv = torch.cat([r.advanced.double() for r in results]) if results else torch.zeros(0, dtype=torch.float64)
        # Each batch numbers its groups from 0: offset them so rounds' groups stay apart.
        offsets = [0]
        for r in results:
            offsets.append(offsets[-1] + (int(r.group_index.max()) + 1 if len(r.group_index) else 0))
        gidx = (torch.cat([r.group_index + o for r, o in zip(results, offsets)]) if results
                else torch.zeros(0, dtype=torch.long))
        agreement = within_group_pearson(base, adv, gidx) if len(samples) > 1 else None
        counts = [sum(int(r.metrics.get(f"reward/{k}", 0.0)) for r in results)
                  for k in ("checker_errors", "checker_timeouts", "judge_errors")]
        noise = self._update_state(samples, base, adv, gidx, agreement, self._next_label(), counts)
        out = []
        for r in results:
            keep = {k: r.metrics[f"reward/{k}"] for k in ("checker_errors", "checker_timeouts", "judge_errors",
                                                             "unknown_task", "no_checker", "checker_skips")}
            new = self._result(r.base.double(), r.advanced.double(), r.group_index, r.checker_scores, keep,
                               r.messages)
            new.metrics = {**r.metrics, **new.metrics}
            for track in ("base", "advanced"):
                if noise.get(track) is not None:
                    new.metrics[f"reward/noise_{track}"] = noise[track]
            if agreement is not None:
                new.metrics["reward/inter_track_agreement"] = agreement
            out.append(new)
        return out

    # -- reliability -----------------------------------------------------------------------------------
    def _noise(self, samples: list[Sample], base: torch.Tensor, adv: torch.Tensor,
               gidx: torch.Tensor) -> dict[str, Optional[float]]:
        """Per-track test-retest noise: re-score a few probe samples, and compare duplicate responses."""
        pairs: list[tuple[int, int]] = []
        first_seen: dict[tuple, int] = {}
        for i, s in enumerate(samples):  # identical responses in one group must get identical scores
            key = (int(gidx[i]), s.prompt, s.response)
            if key in first_seen:
                pairs.append((first_seen[key], i))
            else:
                first_seen[key] = i
        k = min(self.cfg.dynamic.probe_size, len(samples))
        probe = sorted(random.Random(self.step).sample(range(len(samples)), k))  # seeded by step: exact resume
        out: dict[str, Optional[float]] = {}
        a, b = [p for p, _ in pairs], [q for _, q in pairs]
        if probe:
            base2 = torch.tensor(self.base_layer.score([samples[i] for i in probe]).base, dtype=torch.float64)
            groups = {int(gidx[i]) for i in probe}
            members = [i for i in range(len(samples)) if int(gidx[i]) in groups]
            adv_sub, _, _ = self._advanced([samples[i] for i in members], [float(base[i]) for i in members], [])
            adv2 = adv_sub[[members.index(i) for i in probe]]
        else:
            base2 = adv2 = torch.zeros(0, dtype=torch.float64)
        for track, x, retest in (("base", base, base2), ("advanced", adv, adv2)):
            first = torch.cat([x[probe], x[a]]) if probe or a else torch.zeros(0, dtype=torch.float64)
            second = torch.cat([retest, x[b]]) if probe or a else torch.zeros(0, dtype=torch.float64)
            out[track] = noise_ratio(first, second, mean_pairwise_gap(x))
        return out

    def _label_agreement(self) -> dict[str, Optional[float]]:
        """Concordance of each track (and the total) with the eval set's human labels."""
        samples, labels = self.eval_set
        bs = self.base_layer.score(samples)
        base = torch.tensor(bs.base, dtype=torch.float64)
        adv, _, _ = self._advanced(samples, bs.base, [], use_buffer=False)
        gidx, _ = group_index(samples)
        lab = torch.tensor(labels, dtype=torch.float64)
        total = self._combine(base, adv, gidx, self.dynamic.weights)
        return {"base": concordance(base, lab, gidx), "advanced": concordance(adv, lab, gidx),
                "total": concordance(total, lab, gidx)}

    # -- state -----------------------------------------------------------------------------------------
    def push_buffer(self, samples: Sequence[Sample], result: Union[RewardResult, Sequence[float]]) -> None:
        """Keep these samples (with their base scores) as older-policy opponents for later batches."""
        base = result.base.tolist() if isinstance(result, RewardResult) else [float(b) for b in result]
        if len(base) != len(samples):
            raise ValueError(f"push_buffer: {len(samples)} samples but {len(base)} base scores")
        self.buffer.push(samples, base)

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "step": self.step, "weights": self.dynamic.state_dict(),
                "buffer": self.buffer.state_dict(), "totals": dict(self.totals), "label": self._label}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"reward state version {state.get('version')!r} is not {_STATE_VERSION}")
        self.step = int(state["step"])
        self.dynamic.load_state_dict(state["weights"])
        self.buffer.load_state_dict(state["buffer"])
        self.totals = dict(state["totals"])
        self._label = None if state["label"] is None else dict(state["label"])

    def close(self) -> None:
        self.base_layer.close()

    def __enter__(self) -> "DualTrackReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
