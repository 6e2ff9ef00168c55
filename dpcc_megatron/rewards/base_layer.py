"""Base track: the configured rule checkers of each sample's task, combined into one score.

``base = clip(weighted mean of applicable score checkers - sum(weight * penalty), 0, 1)``.

Checkers that raise score 0 (penalties: 1) and are counted; sandboxed checkers
(untrusted code) run on a small thread pool, each run in its own subprocess,
so a batch of code samples costs about ``n / workers`` sandbox runs of wall time.
In-process checkers cannot be pre-empted; they are kept cheap and bounded
instead (e.g. the math checker caps expression size before calling sympy).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..config.base import ConfigError
from ..config.reward import CheckerSpec, RewardConfig, default_task_checkers
from .registry import CheckContext, Checker, CheckerSkipped, CheckerTimeout, get_checker
from .sample import Sample
from .sandbox import SandboxLimits, SandboxStop, build_sandbox

log = logging.getLogger(__name__)


class UnknownTaskError(ValueError):
    """A sample's task has no checkers and reward.fallback_task is not set."""


@dataclass
class _Resolved:
    key: str
    checker: Checker
    weight: float
    params: dict


@dataclass
class BaseScores:
    base: list[float]
    checker_scores: dict[str, list[Optional[float]]]
    """Checker key -> per-sample score (penalties: the penalty); None where it did not run or apply."""
    errors: int = 0
    timeouts: int = 0
    skipped: int = 0
    unknown_task: int = 0
    no_checker: int = 0
    messages: list[str] = field(default_factory=list)


class BaseLayer:
    """Scores samples with the rule checkers configured per task (plus the global penalties)."""

    def __init__(self, cfg: RewardConfig):
        specs = {**default_task_checkers(), **cfg.tasks}
        if cfg.fallback_task is not None and cfg.fallback_task not in specs:
            raise ConfigError(f"reward.fallback_task {cfg.fallback_task!r} has no checkers "
                              f"(tasks: {', '.join(sorted(specs))})")
        p = cfg.penalties
        penalties = [CheckerSpec("overlong", p.overlong_coef, {"max_length": p.max_length, "buffer": p.overlong_buffer}),
                     CheckerSpec("repetition", p.repetition_coef, {"n": p.repetition_ngram,
                                                                   "threshold": p.repetition_threshold})]
        self.tasks: dict[str, list[_Resolved]] = {}
        for task, task_specs in specs.items():
            resolved = []
            for i, spec in enumerate(task_specs):
                try:
                    checker = get_checker(spec.name)
                except KeyError as e:
                    raise ConfigError(f"reward.tasks.{task}[{i}].name: {e.args[0]}") from None
                resolved.append(_Resolved(spec.key or spec.name, checker, spec.weight, dict(spec.params)))
            keys = {r.key for r in resolved}
            for spec in penalties:  # a task that configures a penalty itself keeps its own
                if spec.weight > 0 and spec.name not in keys:
                    resolved.append(_Resolved(spec.name, get_checker(spec.name), spec.weight, dict(spec.params)))
            self.tasks[task] = resolved
        self.fallback_task = cfg.fallback_task
        self.limits = SandboxLimits.from_config(cfg.sandbox)
        self.ctx = CheckContext(sandbox=self.limits)
        self.workers = cfg.sandbox.workers
        self._pool: Optional[ThreadPoolExecutor] = None
        self._warned: set[str] = set()

    def check_sandbox(self, tasks) -> None:
        """Start-up check for a job whose data has ``tasks``: if any uses a sandboxed checker, build the
        sandbox now, which raises a ConfigError naming reward.sandbox.isolation when no isolation is
        available (and warns at every start when it is explicitly ``none``)."""
        fallback = self.tasks.get(self.fallback_task, []) if self.fallback_task else []
        if any(r.checker.sandboxed for t in tasks for r in self.tasks.get(t, fallback)):
            self.ctx = CheckContext(sandbox=build_sandbox(self.limits))

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dpcc-reward-sandbox")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def checkers_for(self, sample: Sample) -> tuple[list[_Resolved], bool]:
        if sample.task in self.tasks:
            return self.tasks[sample.task], True
        if self.fallback_task is None:
            raise UnknownTaskError(f"reward: no checkers for task {sample.task!r} (tasks: "
                                   f"{', '.join(sorted(self.tasks))}); configure it under reward.tasks or set "
                                   "reward.fallback_task to score such samples with another task's checkers")
        if sample.task not in self._warned:
            self._warned.add(sample.task)
            log.warning("reward: no checkers for task %r; using reward.fallback_task %r",
                        sample.task, self.fallback_task)
        return self.tasks[self.fallback_task], False

    def score(self, samples: Sequence[Sample]) -> BaseScores:
        out = BaseScores(base=[], checker_scores={})
        plans = [self.checkers_for(s) for s in samples]
        # Start the sandboxed runs first so they overlap with the in-process checkers.
        futures: dict[tuple[int, int], Future] = {}
        for i, (sample, (resolved, _)) in enumerate(zip(samples, plans)):
            for j, r in enumerate(resolved):
                if r.checker.sandboxed:
                    futures[i, j] = self._executor().submit(r.checker, sample, self.ctx, **r.params)
        for i, (sample, (resolved, known)) in enumerate(zip(samples, plans)):
            out.unknown_task += not known
            total, weight, penalty = 0.0, 0.0, 0.0
            for j, r in enumerate(resolved):
                value = self._run(out, r, sample, futures.get((i, j)))
                out.checker_scores.setdefault(r.key, [None] * len(samples))[i] = value
                if value is None:
                    continue
                if r.checker.kind == "penalty":
                    penalty += r.weight * value
                else:
                    total += r.weight * value
                    weight += r.weight
            if weight == 0:
                out.no_checker += 1
            mean = total / weight if weight > 0 else 0.0
            out.base.append(min(1.0, max(0.0, mean - penalty)))
        return out

    def _run(self, out: BaseScores, r: _Resolved, sample: Sample, future: Optional[Future]) -> Optional[float]:
        worst = 1.0 if r.checker.kind == "penalty" else 0.0
        try:
            value = future.result() if future is not None else r.checker(sample, self.ctx, **r.params)
            if value is None:
                return None
            value = float(value)
            if not (0.0 <= value <= 1.0):  # NaN fails too
                raise ValueError(f"returned {value!r}, outside [0, 1]")
            return value
        except CheckerSkipped as e:
            out.skipped += 1
            self._note(out, f"checker {r.key!r} skipped on task {sample.task!r}: {e}")
            return None
        except (ConfigError, SandboxStop):  # no isolation, or the sandbox service is down: stop the job
            raise
        except CheckerTimeout as e:
            out.timeouts += 1
            self._note(out, f"checker {r.key!r} timed out on task {sample.task!r}: {e}")
        except Exception as e:  # a broken checker must never take the trainer down
            out.errors += 1
            self._note(out, f"checker {r.key!r} failed on task {sample.task!r}: {type(e).__name__}: {e}")
        return worst

    @staticmethod
    def _note(out: BaseScores, msg: str) -> None:
        if len(out.messages) < 20:
            out.messages.append(msg[:500])
