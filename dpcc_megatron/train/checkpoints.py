"""The run's checkpoints: save, resume and roll back (megatron/checkpoint.py does the collective I/O).

    ckpt = Checkpoints(ctx)
    resumed = ckpt.resume(controller)         # the latest checkpoint per checkpoint.resume, or a fresh start
    ckpt.save(iteration, controller, summary, control, pipeline)
    back = ckpt.rollback_to(to_iteration, controller)   # a confirmed collapse: the last healthy checkpoint
    ckpt.finalize_saves(blocking=True)        # asynchronous saves complete before exit
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..config import to_dict
from .optimizers import build_rl_optimizer, total_optimizer_steps


@dataclass
class Resumed:
    """Where a run starts: iteration 0 (fresh), or a checkpoint's iteration with its state."""

    iteration: int = 0
    state: dict = field(default_factory=dict)
    """The checkpoint's trainer state ({} for a fresh start)."""
    in_flight: Optional[dict] = None
    """This rank's rollouts in flight at the save (train/async_rollout.py), for the pipeline to restore."""


class Checkpoints:
    """Save, resume and rollback of one run (every method is collective unless it says otherwise)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.queue = None
        """megatron-core's AsyncCallsQueue when checkpoint.async_save resolved to on, else None."""
        self.last_saved: Optional[int] = None
        """The iteration of this run's latest save."""
        if ctx.cfg.checkpoint.dir:
            from ..megatron.checkpoint import make_async_queue

            self.queue = make_async_queue(ctx.cfg.checkpoint.async_save)

    @property
    def enabled(self) -> bool:
        return bool(self.ctx.cfg.checkpoint.dir)

    def layout(self) -> dict:
        ctx = self.ctx
        p = ctx.cfg.parallel
        return {"tensor_model_parallel_size": p.tensor_model_parallel_size,
                "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
                "data_parallel_size": ctx.dp, "use_distributed_optimizer": p.use_distributed_optimizer}

    # -- save -------------------------------------------------------------------------------------
    def save(self, iteration: int, controller, summary: dict, control=None, pipeline=None,
             weights_only: bool = False) -> None:
        """Collective checkpoint of this iteration (``pipeline``: its rollouts in flight are saved too);
        ``weights_only`` before the first optimizer step."""
        from ..convert.provenance import carried_from, copy_carried
        from ..megatron.checkpoint import save_checkpoint
        from .loading import run_identity

        ctx = self.ctx
        detector = ctx.exchange.detector if ctx.exchange is not None else None
        source, files = carried_from(ctx.cfg.checkpoint.load, ctx.cfg.data.tokenizer)
        state = {"model": to_dict(ctx.cfg.model), "layout": self.layout(), "config": to_dict(ctx.cfg),
                 "run": run_identity(ctx.cfg), "source": source,
                 "controller": controller.state_dict(), "dataset": ctx.dataset.state_dict(),
                 "consumed_samples": ctx.consumed_samples, "counters": dict(ctx.counters),
                 "reward_before": summary.get("reward_before"), "reference": ctx.reference is not None,
                 "monitor_control": control.state_dict() if control is not None else None,
                 "detector": detector.state_dict() if detector is not None else None}
        local = {"reward": ctx.reward.state_dict() if ctx.mp_rank == 0 else None,
                 "rollouts_in_flight": pipeline.state_dict() if pipeline is not None else None}
        # One asynchronous save in flight at a time: its host copy of the shards is freed first.
        self.finalize_saves(blocking=True)
        path = save_checkpoint(ctx.cfg.checkpoint.dir, iteration, ctx.chunks,
                               None if weights_only else ctx.optimizer, ctx.scheduler,
                               state, keep_last=ctx.cfg.checkpoint.keep_last, local_state=local,
                               extra=ctx.reference, async_queue=self.queue, protect=self.rollback_target(),
                               add_files=lambda d: copy_carried(files, d))
        self.last_saved = iteration
        how = "started writing" if self.queue is not None else "saved"
        ctx.log0(f"[dpcc] {how} checkpoint {path}")

    def finalize_saves(self, blocking: bool) -> None:
        """Collective: finalise asynchronous saves that finished on every rank (all with ``blocking``)."""
        from ..megatron.checkpoint import finalize_saves

        for _ in finalize_saves(self.queue, blocking=blocking):
            self.ctx.log0(f"[dpcc] checkpoint finalised: {self.ctx.cfg.checkpoint.dir}/latest updated")

    # -- rollback ---------------------------------------------------------------------------------
    def can_roll_back(self) -> bool:
        """Whether a confirmed collapse can roll this run back (control acting, rollback on, checkpoints)."""
        cfg = self.ctx.cfg
        m = cfg.monitor
        return bool(cfg.checkpoint.dir) and m.acts_on("rollback") and m.rollback_on_collapse

    def rollback_target(self) -> Optional[int]:
        """The iteration whose checkpoint retention keeps for a rollback (rank 0's local detector); None
        when the run cannot roll back. See :func:`..train.control.retention_target`."""
        ctx = self.ctx
        detector = ctx.exchange.detector if ctx.exchange is not None else None
        if not self.can_roll_back() or detector is None:
            return None
        from .control import retention_target

        return retention_target(getattr(detector, "last_healthy_iteration", None),
                                getattr(detector, "evidence_window", 1), ctx.cfg.monitor)

    def rollback_to(self, to_iteration: Optional[int], controller) -> Optional[int]:
        """Load the newest kept checkpoint at or before ``to_iteration``; None when there is none.

        Weights, optimizer, schedule, DPCC controller and detector go back; the prompt stream
        keeps moving forward, so the run does not replay the batches that led to the collapse.
        """
        from ..megatron.checkpoint import retire_newer_than

        ctx = self.ctx
        if not ctx.cfg.checkpoint.dir:
            return None
        self.finalize_saves(blocking=True)
        root = Path(ctx.cfg.checkpoint.dir)
        kept = sorted(int(p.name[5:]) for p in root.glob("iter_*") if (p / "trainer_state.json").is_file())
        eligible = [i for i in kept if to_iteration is None or i <= to_iteration]
        if not eligible:
            return None
        path = root / f"iter_{eligible[-1]:07d}"
        state = self._load("rolling back to", path)
        controller.load_state_dict(state["controller"])
        if ctx.exchange is not None:
            ctx.exchange.rolled_back(int(state["iteration"]), state.get("detector"))
        if ctx.rank == 0:  # the abandoned branch's checkpoints go (see retire_newer_than)
            retire_newer_than(root, int(state["iteration"]))
        if dist.is_initialized() and ctx.world > 1:
            dist.barrier()
        ctx.counters["rollbacks"] = ctx.counters.get("rollbacks", 0) + 1
        ctx.log0(f"[dpcc] rolled back to {path}")
        return int(state["iteration"])

    # -- resume -----------------------------------------------------------------------------------
    def resume(self, controller) -> Resumed:
        """Load the latest checkpoint of checkpoint.dir per checkpoint.resume (or start fresh)."""
        from ..megatron.checkpoint import CheckpointError, latest_checkpoint, load_local_state

        ctx = self.ctx
        ck = ctx.cfg.checkpoint
        self._sweep_checkpoint_dir()
        path = latest_checkpoint(ck.dir) if (ck.dir and ck.resume != "never") else None
        if path is None:
            if ck.resume == "required":
                raise FileNotFoundError(f"checkpoint.resume is 'required' but {ck.dir} has no checkpoint "
                                        "(set checkpoint.resume=auto to start fresh)")
            return Resumed()
        self._check_same_run(path)
        build_rl_optimizer(ctx, total_optimizer_steps(ctx.cfg))
        state = self._load("resuming from", path)
        controller.load_state_dict(state["controller"])
        ctx.dataset.load_state_dict(state["dataset"])
        ctx.consumed_samples = state["consumed_samples"]
        ctx.counters.update(state["counters"])
        if ctx.exchange is not None:
            ctx.exchange.load_detector_state(state.get("detector"))
        saved = load_local_state(path)
        if ctx.mp_rank == 0:
            if saved.get("reward") is None:
                raise CheckpointError(f"{path}: rank {ctx.rank} holds the reward model but its saved state is empty")
            ctx.reward.load_state_dict(saved["reward"])
        ctx.log0(f"[dpcc] resumed from {path} at iteration {state['iteration']}")
        return Resumed(int(state["iteration"]), state, saved.get("rollouts_in_flight"))

    def _load(self, what: str, path: Path) -> dict:
        """Weights, optimizer, schedule (and our reference) from the checkpoint at ``path``; its trainer state."""
        from ..megatron.checkpoint import load_checkpoint

        ctx = self.ctx
        current = {"model": to_dict(ctx.cfg.model), "layout": self.layout()}
        with self._loading(what, path):
            state = load_checkpoint(path, ctx.chunks, ctx.optimizer, ctx.scheduler, current,
                                    extra=self._reference_in(path))
        self._fresh_optimizer_if_weights_only(state)
        return state

    def _fresh_optimizer_if_weights_only(self, state: dict) -> None:
        """A checkpoint saved before the first step has no Adam state: start a fresh optimizer (built
        after the weights were loaded, so its main parameters are theirs) at the saved schedule."""
        if state.get("optimizer_saved") is not False:
            return

        build_rl_optimizer(self.ctx, total_optimizer_steps(self.ctx.cfg))
        if state.get("scheduler"):
            self.ctx.scheduler.load_state_dict(state["scheduler"])

    def _loading(self, what: str, path):
        """Context: the load of ``path`` announced (what it holds, this job's layout) with progress (rank 0)."""
        from .loading import announce

        return announce(what, path, self.ctx.cfg, self.ctx.dp, self.ctx.rank)

    def _sweep_checkpoint_dir(self) -> None:
        """Rank 0: remove saves an interrupted run left half-written; say what checkpoint.dir holds when
        this run starts afresh over another run's checkpoints."""
        from ..megatron.checkpoint import CheckpointError, latest_checkpoint, remove_interrupted_saves

        ck = self.ctx.cfg.checkpoint
        if not ck.dir or self.ctx.rank != 0:
            return
        for name in remove_interrupted_saves(ck.dir):
            print(f"[dpcc] removed {Path(ck.dir) / name}: a save that never finished (the run writing it "
                  f"was interrupted)", flush=True)
        if ck.resume == "never" and (Path(ck.dir) / "latest").is_file():
            try:
                it = json.loads((latest_checkpoint(ck.dir) / "trainer_state.json").read_text()).get("iteration")
            except (CheckpointError, OSError, ValueError) as e:  # this run starts afresh either way
                it = f"unknown: {e}"
            print(f"[dpcc] WARNING: {ck.dir} holds another run's checkpoints (latest: iteration {it}); "
                  f"checkpoint.resume=never starts afresh, and this run's saves replace `latest` and retire "
                  f"those checkpoints (checkpoint.keep_last)", flush=True)

    def _check_same_run(self, path: Path) -> None:
        """Refuse to resume a checkpoint of an unrelated or later run, saying so plainly (every rank
        reads the same file, so every rank raises)."""
        from ..megatron.checkpoint import CheckpointError
        from .loading import identity_problems

        try:
            saved = json.loads((path / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}/trainer_state.json is unreadable: {e}") from None
        errors, notes = identity_problems(saved, self.ctx.cfg)
        if errors:
            raise CheckpointError(f"checkpoint.dir {self.ctx.cfg.checkpoint.dir} cannot be resumed by this run: its "
                                  f"latest checkpoint {path.name} " + "; ".join(errors)
                                  + ". Use another checkpoint.dir for a new run.")
        for note in notes:
            self.ctx.log0(f"[dpcc] note: resuming {path}: {note}")

    def _reference_in(self, path: Path):
        """The reference to restore from the checkpoint at ``path``: ours when it saved one. A checkpoint
        without one (saved with ref_kl_coef 0) is refused unless loss.ref_model_path names the reference."""
        ctx = self.ctx
        if ctx.reference is None:
            return None
        if json.loads((path / "trainer_state.json").read_text()).get("reference"):
            return ctx.reference
        if ctx.cfg.loss.ref_model_path:
            return None  # the reference built from ref_model_path stays
        from ..megatron.checkpoint import CheckpointError

        raise CheckpointError(f"{path} holds no reference model (it was saved with loss.ref_kl_coef 0); set "
                              "loss.ref_model_path to choose the reference for this run")
