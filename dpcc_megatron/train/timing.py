"""Where an iteration's time and memory go: phase timers and the peak memory of the iteration.

    timer = PhaseTimer()
    timer.start_iteration()                  # resets the device's peak-memory counter
    with timer.phase("rollout"):
        ...
    record.update(timer.record_fields(ctx.engine, world_max=True))

Record fields (seconds of wall time on this rank, rank 0's in the log):

- ``time_rollout_s``: sampling and scoring (with dynamic sampling every round), less the refit;
- ``time_refit_s``: the rollout engine's weight refit in this iteration (``engine.last_refit_s``;
  0 where the engine decodes with the training weights, or when no refit ran). The engine reports
  its last refit only: with dynamic sampling each further round refits again, and those refits stay
  in ``time_rollout_s``. With ``rollout.max_staleness`` >= 1 the pipeline refits the idle engine
  before it starts the next background generation, inside the rollout phase: counted here the same
  way. (The one refit field: the record has no other.)
- ``time_logprobs_s``: the old-policy and reference log-prob passes (``time_logprobs_old_s``,
  ``time_logprobs_ref_s`` each);
- ``time_update_s``: the inner epochs of optimizer steps, the parameter all-gather and the drift probe;
- ``time_checkpoint_s`` / ``time_eval_s``: the checkpoint save and the held-out evaluation that ran
  since the previous record (both run after an iteration's record is sent, so iteration i's record
  carries what ran at the end of iteration i-1), with the asynchronous saves finalised at its start;
- ``peak_device_memory_gib``: the largest ``torch.cuda.max_memory_allocated`` of any rank during the
  iteration (PyTorch's allocator: memory a colocated vLLM engine holds in its own pool is not in it);
  None without CUDA (the console says n/a);
- ``host_peak_rss_gib``: the largest peak resident set of any rank's process since it started
  (``getrusage`` ``ru_maxrss``): a lifetime high-water mark, not the iteration's.

With CUDA each phase boundary synchronises the device, so the kernels a phase queued count in it.
"""
from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from typing import Optional

import torch

PHASES = ("rollout", "logprobs_old", "logprobs_ref", "update", "checkpoint", "eval")
GIB = float(1 << 30)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_peak_rss_bytes() -> int:
    """This process's peak resident set since it started (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class PhaseTimer:
    """Accumulates seconds per phase until :meth:`record_fields` hands them over and starts afresh."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._refits_before: Optional[int] = None
        self._open: dict[str, float] = {}

    def start_iteration(self, engine=None) -> None:
        """Call at the top of an iteration: resets the device peak-memory counter, notes the engine's refits."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._refits_before = getattr(engine, "refits", None)

    def start(self, name: str) -> None:
        """Open phase ``name`` (closed by :meth:`stop`; :meth:`phase` does both around a block)."""
        if name not in self.seconds:
            raise KeyError(f"unknown phase {name!r}; one of {', '.join(PHASES)}")
        if name in self._open:
            raise RuntimeError(f"phase {name!r} is already open")
        _sync()
        self._open[name] = self.clock()

    def stop(self, name: str) -> None:
        if name not in self._open:
            raise RuntimeError(f"phase {name!r} was not started")
        _sync()
        self.seconds[name] += self.clock() - self._open.pop(name)

    @contextmanager
    def phase(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def refit_seconds(self, engine) -> float:
        """The engine's refit time when it refitted since :meth:`start_iteration` (engines that count
        their refits say so; others report their last one, 0 when they never refit)."""
        last = float(getattr(engine, "last_refit_s", 0.0) or 0.0)
        refits = getattr(engine, "refits", None)
        if refits is not None and self._refits_before is not None and refits == self._refits_before:
            return 0.0
        return last

    def record_fields(self, engine=None, world_max: bool = True) -> dict:
        """The iteration's timing and memory fields; resets the accumulated seconds.

        Collective when ``world_max`` and torch.distributed is initialised (every rank calls it):
        the memory figures are the maximum over ranks."""
        s = self.seconds
        refit = self.refit_seconds(engine) if engine is not None else 0.0
        out = {
            "time_rollout_s": max(0.0, s["rollout"] - refit),
            "time_refit_s": refit,
            "time_logprobs_s": s["logprobs_old"] + s["logprobs_ref"],
            "time_logprobs_old_s": s["logprobs_old"],
            "time_logprobs_ref_s": s["logprobs_ref"],
            "time_update_s": s["update"],
            "time_checkpoint_s": s["checkpoint"],
            "time_eval_s": s["eval"],
        }
        device = float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else -1.0
        host = float(host_peak_rss_bytes())
        if world_max:
            device, host = _max_over_ranks(device, host)
        out["peak_device_memory_gib"] = device / GIB if device >= 0 else None
        out["host_peak_rss_gib"] = host / GIB
        self.seconds = dict.fromkeys(PHASES, 0.0)
        return out

    def after_last_record(self) -> dict:
        """The summary's ``time_final_checkpoint_s`` / ``time_final_eval_s``: what ran after the last record."""
        return {"time_final_checkpoint_s": self.seconds["checkpoint"], "time_final_eval_s": self.seconds["eval"]}


def _max_over_ranks(*values: float) -> list[float]:
    from ..distributed import reduce_values

    return reduce_values(values, "max")


def console_fields(r: dict) -> str:
    """The console's timing segment: ``time rollout/refit/logprobs/update/ckpt/eval: ... s | peak mem: ...``."""
    def f(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else f"{float(v):.1f}"

    mem = r.get("peak_device_memory_gib")
    return (f"time rollout/refit/logprobs/update/ckpt/eval (s): {f('time_rollout_s')}/{f('time_refit_s')}/"
            f"{f('time_logprobs_s')}/{f('time_update_s')}/{f('time_checkpoint_s')}/{f('time_eval_s')} | "
            f"peak mem: {'n/a' if mem is None else f'{float(mem):.1f} GiB'}")
