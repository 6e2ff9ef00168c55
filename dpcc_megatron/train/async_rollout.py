"""Rollouts with bounded staleness (``rollout.max_staleness: k``).

**Versions.** The weights the trainer holds at the start of iteration i are version i: one version per
iteration's update, which is also what the rollout engine is refit to at most once per iteration. A
sample produced by version v and trained on at iteration i has staleness i - v.

**The pipeline.** With k = 0 every iteration samples with its own weights (:func:`sample_iteration`,
the synchronous loop, unchanged). With k >= 1, at iteration i, before its update:

1. :meth:`RolloutPipeline.take` hands over iteration i's samples, requested at iteration i - k (at
   the start of a run, after a rollback or a resume that kept nothing: requested now, staleness 0);
2. :meth:`RolloutPipeline.submit_ahead` requests iterations i + 1 .. i + k that are not yet requested,
   from the current weights (version i),

so in the steady state every batch is exactly k versions old, and never more than k. The prompts,
sampling seeds and dynamic-sampling rounds of iteration j are those the synchronous loop would use
for j; only the weights that sampled them differ.

**How a request runs** depends on the engine:

* ``overlap`` (the vLLM engine, whose weights live in its own process, with one rank per
  model-parallel group and without dynamic sampling): the request refits the engine to the current
  weights when it is idle, draws its prompts and starts the generation in a background thread; the
  trainer trains meanwhile and :meth:`take` waits for the result. Generation of i + 1 overlaps the
  update of i. At most one generation runs at a time, so the engine is refit only when idle.
* ``snapshot`` (the Megatron engine, which decodes with the training weights themselves; also vLLM with
  TP x PP > 1, whose generate broadcasts over the model-parallel group, or with dynamic sampling,
  whose rounds score between generations): the request keeps a host copy of this rank's shard of the
  current weights, and :meth:`take` swaps it into the model, samples iteration i exactly as the
  synchronous loop would (rounds included), and swaps the current weights back. The staleness
  semantics are the same; there is no overlap (generation and training still take turns on the same
  devices), so this mode buys no throughput: it is how an off-policy run is reproduced without a
  separate engine.

**Checkpoints.** :meth:`state_dict` holds every request in flight, so a resumed run continues exactly:
an ``overlap`` request is finished first and its generation kept (its prompts were already drawn, and
the dataset position saved with them); a ``snapshot`` request keeps its weight shard (k model shards
per rank on disk, in the rank's local state). A rollback discards the requests of the abandoned branch
(:meth:`reset`): the next iteration samples from the restored weights.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import reduce_values
from .refit import agreed
from .rollout import finish_rollouts, rollout_request, sampling_params, score_rollouts
from .sampling import IterationSamples, sample_iteration

_STATE_VERSION = 1
_OVERLAP_ENGINES = ("vllm",)
"""Engines whose weights live outside the trainer's model, so they can generate while it trains."""


def overlap_possible(cfg, engine_name: str, mp_world: int) -> Optional[str]:
    """None when requests can generate in the background; otherwise why they run as snapshots."""
    if engine_name not in _OVERLAP_ENGINES:
        return f"rollout.engine {engine_name!r} decodes with the training weights themselves"
    if mp_world > 1:
        return "the engine's generate is collective over the model-parallel group (TP x PP > 1)"
    if cfg.rollout.dynamic_sampling:
        return "rollout.dynamic_sampling scores between generation rounds"
    return None


@dataclass
class _Request:
    iteration: int
    version: int
    snapshot: Optional[list] = None
    """``snapshot`` mode: this rank's parameters at ``version`` (host copies, in parameter order)."""
    prompts: Optional[list] = None
    """``overlap`` mode: the prompts drawn for the iteration (all DP ranks' shares)."""
    request: object = None
    generation: object = None
    error: Optional[BaseException] = None
    thread: Optional[threading.Thread] = field(default=None, repr=False)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            raise RuntimeError(f"rollout generation for iteration {self.iteration} failed: {self.error}") from self.error


def _params(chunks) -> list:
    return [p for c in chunks for p in c.parameters()]


class _Swapped:
    """Context manager: ``snapshot`` in the model's parameters, the current ones back on exit."""

    def __init__(self, chunks, snapshot: list):
        self.params, self.snapshot, self.saved = _params(chunks), snapshot, None

    def __enter__(self):
        self.saved = [p.detach().to("cpu", copy=True) for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.snapshot):
                p.copy_(s)
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for p, s in zip(self.params, self.saved):
                p.copy_(s)
        self.saved = None
        return False


class RolloutPipeline:
    """Requests in flight for the next iterations; see the module docstring."""

    def __init__(self, ctx):
        self.k = ctx.cfg.rollout.max_staleness
        mp_world = dist.get_world_size(ctx.mp_group) if dist.is_initialized() and ctx.mp_group is not None else 1
        self.why_no_overlap = overlap_possible(ctx.cfg, ctx.engine.name, mp_world) if self.k else None
        self.mode = "overlap" if self.k and self.why_no_overlap is None else "snapshot"
        self.inflight: dict[int, _Request] = {}
        self.discarded = 0
        """Requests dropped by rollbacks (their samples were never trained on)."""
        if self.k and getattr(ctx, "rank", 0) == 0:
            how = ("generation overlaps training" if self.mode == "overlap" else
                   f"no overlap ({self.why_no_overlap}): each iteration samples from a weight snapshot")
            print(f"[dpcc] rollout.max_staleness={self.k}: {self.mode} mode, {how}", flush=True)

    @property
    def overlapping(self) -> bool:
        """Whether a generation may be running in the background (the engine must then stay awake)."""
        return self.k > 0 and self.mode == "overlap"

    # -- the two calls of an iteration ---------------------------------------------------------------
    def take(self, ctx, iteration: int) -> IterationSamples:
        """Iteration ``iteration``'s samples (the synchronous loop's when k = 0), with ``versions``."""
        if self.k == 0:
            return sample_iteration(ctx, iteration)
        req = self.inflight.pop(iteration, None)
        if req is None:  # nothing requested (start, rollback, resume): sample from the current weights
            req = self._submit(ctx, iteration, version=iteration)
        samples = self._run(ctx, req)
        samples.weight_version = req.version
        return samples

    def submit_ahead(self, ctx, iteration: int, last: int) -> None:
        """Request iterations ``iteration + 1 .. iteration + k`` (below ``last``) from the current weights."""
        for j in range(iteration + 1, min(iteration + self.k, last - 1) + 1):
            if j not in self.inflight:
                self.inflight[j] = self._submit(ctx, j, version=iteration)

    def reset(self) -> None:
        """Drop every request in flight (a rollback abandoned the weights they were sampled with)."""
        for req in self.inflight.values():
            try:
                req.wait()
            except RuntimeError:
                pass
        self.discarded += len(self.inflight)
        self.inflight.clear()

    def wait_idle(self) -> None:
        """Wait for any background generation, so the engine is idle (before anything else refits or uses
        it, such as the held-out evaluation); its result stays in flight for its iteration."""
        for req in self.inflight.values():
            if req.thread is not None:
                req.thread.join()
                req.thread = None

    def close(self) -> None:
        """At the end of the run: no generation thread outlives it."""
        self.wait_idle()

    # -- requests ------------------------------------------------------------------------------------
    def _submit(self, ctx, iteration: int, version: int) -> _Request:
        if self.mode == "snapshot":
            return _Request(iteration, version, snapshot=[p.detach().to("cpu", copy=True) for p in _params(ctx.chunks)])
        for other in self.inflight.values():  # the engine is refit only when idle
            other.wait()
        ctx.weights.refit()
        prompts = ctx.dataset.next_batch(ctx.cfg.rollout.prompts_per_iteration)
        req = _Request(iteration, version, prompts=prompts, request=rollout_request(ctx, prompts, iteration))
        self._start(ctx, req)
        return req

    def _start(self, ctx, req: _Request) -> None:
        sampling = sampling_params(ctx, greedy=False, seed=req.request.seed)

        def run():
            try:
                req.generation = ctx.engine.generate(req.request.prompt_ids, sampling)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait() in the trainer's thread
                req.error = e

        req.thread = threading.Thread(target=run, name=f"rollout-{req.iteration}", daemon=True)
        req.thread.start()

    def _run(self, ctx, req: _Request) -> IterationSamples:
        if req.snapshot is not None:
            with _Swapped(ctx.chunks, req.snapshot):
                ctx.engine.weight_version = None  # the engine serves the snapshot now, the current weights after
                try:
                    ctx.weights.refit()
                    return sample_iteration(ctx, req.iteration)
                finally:
                    ctx.engine.weight_version = None
        agreed(ctx.weights.rank, req.wait)  # a generation that failed on any rank stops every rank
        rollouts = finish_rollouts(ctx, req.request, req.generation)
        return IterationSamples(rollouts, score_rollouts(ctx, rollouts), len(req.prompts))

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """Every request in flight (background generations finished first); None when k = 0."""
        if self.k == 0:
            return None
        out = []
        for j, req in sorted(self.inflight.items()):
            req.wait()
            out.append({"iteration": j, "version": req.version, "snapshot": req.snapshot, "prompts": req.prompts,
                        "request": None if req.request is None else vars(req.request),
                        "generation": req.generation})
        return {"version": _STATE_VERSION, "mode": self.mode, "k": self.k, "requests": out,
                "discarded": self.discarded}

    def load_state_dict(self, state: Optional[dict], ctx) -> None:
        """Restore :meth:`state_dict`; a checkpoint written with another k or mode is refused, naming why."""
        if self.k == 0 and state is None:
            return
        if self.k == 0:
            from ..megatron.checkpoint import CheckpointError

            raise CheckpointError(f"the checkpoint holds rollouts in flight of rollout.max_staleness={state.get('k')}; "
                                  "resume it with that rollout.max_staleness")
        from ..megatron.checkpoint import CheckpointError
        from .rollout import RolloutRequest

        if state is None:  # a synchronous run's checkpoint (or one from before the first update)
            if dist.is_initialized() and dist.get_rank() == 0 or not dist.is_initialized():
                print(f"[dpcc] rollout.max_staleness={self.k}: the checkpoint holds no rollouts in flight; the "
                      "first iteration samples from the resumed weights", flush=True)
            return
        if state.get("version") != _STATE_VERSION or state["k"] != self.k or state["mode"] != self.mode:
            raise CheckpointError(
                f"the checkpoint holds rollouts in flight for rollout.max_staleness={state.get('k')} ({state.get('mode')}), "
                f"this run has {self.k} ({self.mode}); resume with the same rollout.max_staleness and engine")
        self.discarded = int(state.get("discarded", 0))
        self.inflight = {}
        for r in state["requests"]:
            self.inflight[int(r["iteration"])] = _Request(
                int(r["iteration"]), int(r["version"]), snapshot=r["snapshot"], prompts=r["prompts"],
                request=None if r["request"] is None else RolloutRequest(**r["request"]), generation=r["generation"])

    # -- what the record and the controller read -----------------------------------------------------
    def staleness_fields(self, ctx, controller, samples: IterationSamples, batch, iteration: int) -> dict:
        """``staleness_mean``, ``staleness_max`` and ``kl_behaviour`` = KL(pi_b || pi_prox) (k3, token mean
        over every rank's batch); DPCC's controller is told the behaviour KL. Empty when k = 0."""
        if self.k == 0:
            return {}
        from ..algo.decoupled import behaviour_kl

        staleness = (iteration - samples.weight_versions).double()
        kl = _global_behaviour_kl(ctx, batch, behaviour_kl)
        controller.observe_behaviour(kl)
        return {"staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
                "kl_behaviour": kl, "rollout_weight_version": samples.weight_version,
                "rollouts_discarded": self.discarded}


def _global_behaviour_kl(ctx, batch, behaviour_kl) -> float:
    """Token mean of the k3 terms over the whole batch (every DP rank), the same number on every rank.
    Ranks off the last pipeline stage hold no log-probs and add nothing; TP ranks of the last stage add
    identical sums and counts, which leaves the mean unchanged."""
    from megatron.core import parallel_state as ps

    mask = batch.mask.bool()
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    n = float(mask.sum()) if last else 0.0
    total = behaviour_kl(batch.old_logprobs, batch.sampler_logprobs, mask) * n if last and n else 0.0
    total, n = reduce_values([total, n], "sum")
    return total / n if n > 0 else 0.0
