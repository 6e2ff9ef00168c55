"""The rollout engine and the weights it serves: the refit is an explicit step of the iteration.

    weights = EngineWeights(engine, chunks)
    weights.moved()        # the warm-start, an optimizer step or a rollback changed the training weights
    weights.refit()        # the engine takes them, only when they changed since its last refit
    weights.check_fresh()  # before generating: the engine serves the current weights (else a bug)

    out = agreed(rank, lambda: engine.generate(...))  # a failure on any rank raises on every rank
    with EngineStop(ctx, save).at(iteration, "rollouts"):   # an engine failure: save, stop
        ...

The trainer refits before an iteration's rollouts, the evaluator before an evaluation;
dynamic-sampling rounds and evaluations between two optimizer steps reuse the engine's weights
(``rollout/engine.py``'s :class:`~dpcc_megatron.rollout.engine.RefitByVersion`). A refit that does
not take raises :class:`~dpcc_megatron.rollout.engine.EngineFailure` (``RefitError``) on every rank.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from ..distributed import first_error
from ..rollout.engine import EngineFailure

T = TypeVar("T")


class EngineWeights:
    """The rollout engine and the training weights' version (bumped whenever they change)."""

    def __init__(self, engine, chunks, version: int = 0, rank: int = 0):
        self.engine = engine
        self.rank = rank
        self.chunks = chunks
        self.version = version

    def moved(self, changed: bool = True) -> None:
        """The training weights changed (``changed``): the engine is stale until its next refit."""
        self.version += int(changed)

    def refit(self) -> bool:
        """Collective: the engine takes the current weights unless it already serves them; True when it refit.
        A refit that fails on any rank raises :class:`EngineFailure` on every rank."""
        return agreed(self.rank, lambda: self.engine.refit_if_stale(self.chunks, self.version))

    def check_fresh(self) -> None:
        """Raise unless the engine serves the current weights (a generation must follow a refit)."""
        served = getattr(self.engine, "weight_version", self.version)
        if served != self.version:
            raise RuntimeError(f"the rollout engine serves weight version {served}, the trainer holds "
                               f"{self.version}: refit it (EngineWeights.refit) before generating")

    def close(self) -> None:
        self.engine.close()


def agreed(rank: int, call: Callable[[], T]) -> T:
    """``call()``, an engine call every rank makes (a refit, a generate); when it fails on any rank, every
    rank raises :class:`EngineFailure` naming the first failing rank's error (that rank's own
    ``EngineFailure`` where it raised one), so no rank goes on into a collective the others never reach."""
    error = local = None
    try:
        out = call()
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised
        out, local, error = None, e, f"rank {rank}: {type(e).__name__}: {e}"
    first = first_error(error)
    if first is None:
        return out
    if isinstance(local, EngineFailure):
        raise local
    if local is not None:
        raise EngineFailure(first) from local
    raise EngineFailure(f"the rollout engine failed on {first}")


class EngineStop:
    """Around what uses the rollout engine (rollouts, evaluations): an :class:`EngineFailure` (raised on
    every rank alike: see :func:`agreed`) saves a checkpoint of the weights every rank holds (after
    ``iteration`` completed iterations; none before RL starts, or without checkpoint.dir), says so on
    every rank, and stops the run."""

    def __init__(self, ctx, save):
        self.ctx, self.save = ctx, save
        self.iteration, self.what = None, ""

    def at(self, iteration, what: str) -> "EngineStop":
        self.iteration, self.what = iteration, what
        return self

    def __enter__(self) -> "EngineStop":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None or not issubclass(kind, EngineFailure):
            return False
        ctx = self.ctx
        if self.iteration is None:
            saved = "no checkpoint (RL has not started)"
        elif not ctx.checkpoints.enabled:
            saved = "no checkpoint (checkpoint.dir is not set)"
        elif ctx.checkpoints.last_saved == self.iteration:
            ctx.checkpoints.finalize_saves(blocking=True)
            saved = f"the checkpoint after iteration {self.iteration} is in {ctx.cfg.checkpoint.dir}"
        else:
            self.save(self.iteration)
            ctx.checkpoints.finalize_saves(blocking=True)
            saved = f"saved a checkpoint after iteration {self.iteration} in {ctx.cfg.checkpoint.dir}"
        print(f"[dpcc] rank {ctx.rank}: stopping: the rollout engine failed during {self.what} ({error}); "
              f"{saved}", flush=True)
        return False
