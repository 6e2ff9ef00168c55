"""Everything one rank holds during a run: process groups, model, optimizer, data, reward, monitor."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..config import JobConfig, to_dict
from ..data.prompts import PromptDataset, synthetic_prompts
from ..data.tokenizer import build_tokenizer, resolve_vocab_size
from ..megatron.policy_step import RLBatch, compute_logprobs


@dataclass
class RunContext:
    cfg: JobConfig
    rank: int
    world: int
    dp: int
    dp_rank: int
    mp_rank: int
    dp_group: object
    pp_group: object
    tp_group: object
    mp_group: object
    chunks: list
    tokenizer: object
    dataset: PromptDataset
    eval_prompts: list
    reward: object
    vocab_size: int
    out_dir: Path
    optimizer: object = None
    scheduler: object = None
    reference: object = None
    """The frozen reference policy (megatron.reference.ReferencePolicy) when loss.ref_kl_coef > 0."""
    engine: object = None
    """The rollout engine (rollout/engine.py interface), built by train/engines.py."""
    weight_version: int = 0
    """Bumped whenever the training weights change (warm-start, optimizer steps, rollback); the engine
    refits only when it serves another version (engine.refit_if_stale)."""
    monitor: object = None
    detector: object = None
    sidecar_advice: object = None
    """train.control.SidecarAdvice: sidecar vs local-detector advice (rank 0, with a sidecar)."""
    loggers: object = None
    """ExperimentLoggers (TensorBoard, wandb) on rank 0."""
    evaluator: object = None
    """The held-out evaluation (train/evaluate.py)."""
    consumed_samples: int = 0
    resumed_state: dict = field(default_factory=dict)
    counters: dict = field(default_factory=lambda: {"steps_taken": 0, "steps_skipped": 0, "prompts_truncated": 0,
                                                    "rollbacks": 0, "fp16_overflows": 0,
                                                    "advice_fallbacks": 0, "sft_truncated": 0})
    alerts: list = field(default_factory=list)
    records: list = field(default_factory=list)
    rollout_pipeline: object = None
    """train.async_rollout.RolloutPipeline: rollouts in flight (rollout.max_staleness), saved with checkpoints."""
    resumed_in_flight: object = None
    """The resumed checkpoint's rollouts in flight (this rank's), for the pipeline to restore."""
    ckpt_queue: object = None
    """megatron-core's AsyncCallsQueue when checkpoint.async_save resolved to on, else None."""

    # -- optimizers -------------------------------------------------------------------------------
    def build_optimizer(self, lr: Optional[float] = None):
        import dataclasses

        from ..megatron.optimizer import build_optimizer

        optim = self.cfg.optim if lr is None else dataclasses.replace(self.cfg.optim, lr=lr, min_lr=0.0)
        return build_optimizer(self.chunks, optim, self.cfg.parallel, self.cfg.precision)

    def build_rl_optimizer(self, total_steps: int) -> None:
        from ..megatron.optimizer import build_scheduler

        self.optimizer = self.build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optim, total_steps)

    # -- passes -----------------------------------------------------------------------------------
    def logprobs(self, batch: RLBatch):
        """Old-policy log-probs and entropies, moved to the host once: every other per-sample tensor
        of the iteration (masks, advantages, rewards, sampler log-probs) lives there, and the loss
        functions move each micro-batch's slice to the device of the schedule's outputs."""
        from .devices import to_host

        lp, ent = compute_logprobs(self.chunks, batch, micro_batch_size=self.cfg.train.micro_batch_size,
                                   vocab_size=self.vocab_size, dp_size=self.dp,
                                   max_tokens=self.cfg.train.max_tokens_per_micro_batch,
                                   record_routing=self.cfg.rollout.routing_replay)  # MoE: sets batch.routing
        return to_host(lp), to_host(ent)

    def ref_logprobs(self, batch: RLBatch):
        """log pi_ref of the batch on the host (last pipeline stage; zeros elsewhere), or None without a
        reference."""
        from .devices import to_host

        if self.reference is None:
            return None
        lp = self.reference.logprobs(batch, micro_batch_size=self.cfg.train.micro_batch_size,
                                     vocab_size=self.vocab_size, dp_size=self.dp,
                                     max_tokens=self.cfg.train.max_tokens_per_micro_batch)
        return to_host(lp) if lp is not None else torch.zeros(batch.mask.shape)

    def sft_batch(self, step: int) -> RLBatch:
        """Gold prompt+response pairs (this DP rank's share): from the training data, or the synthetic task."""
        from .sft import sft_batch

        return sft_batch(self, step)

    # -- checkpoints ------------------------------------------------------------------------------
    def layout(self) -> dict:
        p = self.cfg.parallel
        return {"tensor_model_parallel_size": p.tensor_model_parallel_size,
                "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
                "data_parallel_size": self.dp, "use_distributed_optimizer": p.use_distributed_optimizer}

    def save(self, iteration: int, controller, summary: dict, control=None, weights_only: bool = False) -> None:
        """Collective checkpoint of this iteration; ``weights_only`` before the first optimizer step."""
        from ..megatron.checkpoint import save_checkpoint

        from .loading import run_identity

        from ..convert.provenance import carried_from, copy_carried

        source, files = carried_from(self.cfg.checkpoint.load, self.cfg.data.tokenizer)
        state = {"model": to_dict(self.cfg.model), "layout": self.layout(), "config": to_dict(self.cfg),
                 "run": run_identity(self.cfg), "source": source,
                 "controller": controller.state_dict(), "dataset": self.dataset.state_dict(),
                 "consumed_samples": self.consumed_samples, "counters": dict(self.counters),
                 "reward_before": summary.get("reward_before"), "reference": self.reference is not None,
                 "monitor_control": control.state_dict() if control is not None else None,
                 "detector": self.detector.state_dict() if self.detector is not None else None}
        local = {"reward": self.reward.state_dict() if self.mp_rank == 0 else None,
                 "rollouts_in_flight": (self.rollout_pipeline.state_dict() if self.rollout_pipeline is not None
                                        else None)}
        # One asynchronous save in flight at a time: its host copy of the shards is freed first.
        self.finalize_saves(blocking=True)
        path = save_checkpoint(self.cfg.checkpoint.dir, iteration, self.chunks,
                               None if weights_only else self.optimizer, self.scheduler,
                               state, keep_last=self.cfg.checkpoint.keep_last, local_state=local,
                               extra=self.reference, async_queue=self.ckpt_queue, protect=self.rollback_target(),
                               add_files=lambda d: copy_carried(files, d))
        if self.rank == 0:
            how = "started writing" if self.ckpt_queue is not None else "saved"
            print(f"[dpcc] {how} checkpoint {path}", flush=True)

    def _fresh_optimizer_if_weights_only(self, state: dict) -> None:
        """A checkpoint saved before the first step has no Adam state: start a fresh optimizer (built
        after the weights were loaded, so its main parameters are theirs) at the saved schedule."""
        if state.get("optimizer_saved") is not False:
            return
        from .trainer_totals import total_optimizer_steps

        self.build_rl_optimizer(total_optimizer_steps(self.cfg))
        if state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])

    def can_roll_back(self) -> bool:
        """Whether a confirmed collapse can roll this run back (control acting, rollback on, checkpoints)."""
        m = self.cfg.monitor
        return bool(self.cfg.checkpoint.dir) and m.acts_on("rollback") and m.rollback_on_collapse

    def rollback_target(self) -> Optional[int]:
        """The iteration whose checkpoint retention keeps for a rollback (rank 0's local detector); None
        when the run cannot roll back. See :func:`..train.control.retention_target`."""
        if not self.can_roll_back() or self.detector is None:
            return None
        from .control import retention_target

        return retention_target(getattr(self.detector, "last_healthy_iteration", None),
                                getattr(self.detector, "evidence_window", 1), self.cfg.monitor)

    def finalize_saves(self, blocking: bool) -> None:
        """Collective: finalise asynchronous saves that finished on every rank (all with ``blocking``)."""
        from ..megatron.checkpoint import finalize_saves

        for _ in finalize_saves(self.ckpt_queue, blocking=blocking):
            if self.rank == 0:
                print(f"[dpcc] checkpoint finalised: {self.cfg.checkpoint.dir}/latest updated", flush=True)

    def resume(self, controller) -> int:
        """Load the latest checkpoint of checkpoint.dir per checkpoint.resume; returns the start iteration."""
        from ..megatron.checkpoint import CheckpointError, load_checkpoint, load_local_state, latest_checkpoint
        from .trainer_totals import total_optimizer_steps

        ck = self.cfg.checkpoint
        self._sweep_checkpoint_dir()
        path = latest_checkpoint(ck.dir) if (ck.dir and ck.resume != "never") else None
        if path is None:
            if ck.resume == "required":
                raise FileNotFoundError(f"checkpoint.resume is 'required' but {ck.dir} has no checkpoint "
                                        "(set checkpoint.resume=auto to start fresh)")
            return 0
        self._check_same_run(path)
        self.build_rl_optimizer(total_optimizer_steps(self.cfg))
        current = {"model": to_dict(self.cfg.model), "layout": self.layout()}
        with self._loading("resuming from", path):
            state = load_checkpoint(path, self.chunks, self.optimizer, self.scheduler, current,
                                    extra=self._reference_in(path))
        self._fresh_optimizer_if_weights_only(state)
        controller.load_state_dict(state["controller"])
        self.dataset.load_state_dict(state["dataset"])
        self.consumed_samples = state["consumed_samples"]
        self.counters.update(state["counters"])
        if self.detector is not None and state.get("detector"):
            self.detector.load_state_dict(state["detector"])
        saved = load_local_state(path)
        self.resumed_in_flight = saved.get("rollouts_in_flight")
        if self.mp_rank == 0:
            if saved.get("reward") is None:
                raise CheckpointError(f"{path}: rank {self.rank} holds the reward model but its saved state is empty")
            self.reward.load_state_dict(saved["reward"])
        self.resumed_state = state
        if self.rank == 0:
            print(f"[dpcc] resumed from {path} at iteration {state['iteration']}", flush=True)
        return int(state["iteration"])

    def log0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def _loading(self, what: str, path):
        """Context: the load of ``path`` announced (what it holds, this job's layout) with progress (rank 0)."""
        from .loading import announce

        return announce(what, path, self.cfg, self.dp, self.rank)

    def _sweep_checkpoint_dir(self) -> None:
        """Rank 0: remove saves an interrupted run left half-written; say what checkpoint.dir holds when
        this run starts afresh over another run's checkpoints."""
        from ..megatron.checkpoint import CheckpointError, latest_checkpoint, remove_interrupted_saves

        ck = self.cfg.checkpoint
        if not ck.dir or self.rank != 0:
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
        errors, notes = identity_problems(saved, self.cfg)
        if errors:
            raise CheckpointError(f"checkpoint.dir {self.cfg.checkpoint.dir} cannot be resumed by this run: its "
                                  f"latest checkpoint {path.name} " + "; ".join(errors)
                                  + ". Use another checkpoint.dir for a new run.")
        for note in notes:
            self.log0(f"[dpcc] note: resuming {path}: {note}")

    def _reference_in(self, path: Path):
        """The reference to restore from the checkpoint at ``path``: ours when it saved one. A checkpoint
        without one (saved with ref_kl_coef 0) is refused unless loss.ref_model_path names the reference."""
        import json as _json

        if self.reference is None:
            return None
        if _json.loads((path / "trainer_state.json").read_text()).get("reference"):
            return self.reference
        if self.cfg.loss.ref_model_path:
            return None  # the reference built from ref_model_path stays
        from ..megatron.checkpoint import CheckpointError

        raise CheckpointError(f"{path} holds no reference model (it was saved with loss.ref_kl_coef 0); set "
                              "loss.ref_model_path to choose the reference for this run")

    # -- metrics ----------------------------------------------------------------------------------
    def logprob_stats(self, batch, rollouts, old_lp, entropy) -> dict:
        """Computed on the last pipeline stage, shared with every stage (rank 0 logs them)."""
        from megatron.core import parallel_state as ps

        from .metrics import logprob_stats

        stats = (logprob_stats(batch, rollouts, old_lp, entropy, self.cfg.precision.tis_cap)
                 if old_lp is not None else None)
        if dist.is_initialized() and dist.get_world_size(self.pp_group) > 1:
            box = [stats]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
            stats = box[0]
        return stats or {}

    def iteration_record(self, iteration, rollouts, rewards, adv_metrics, batch, lp_stats, steps,
                         controller, seconds, step_kl_after=None) -> dict:
        from .metrics import build_record

        return build_record(self, iteration, rollouts, rewards, adv_metrics, batch, lp_stats, steps,
                            controller, seconds, step_kl_after)

    def monitor_exchange(self, record: dict) -> Optional[tuple]:
        """Rank 0 runs the local detector, sends the record and polls the sidecar's advice.

        Advice comes from the sidecar when one is configured, else from the local detector
        through the same alert -> advice policy, so control works without a sidecar too.
        With a sidecar, rank 0 waits (up to ``monitor.advice_wait_s``) until the sidecar has
        acknowledged this record, so the advice about iteration i is applied before iteration
        i+1 whatever the timing; on time-out the local detector's advice is used (logged, counted).
        Every rank gets the same ``(action, factor, to_iteration)`` back, or None.
        """
        advice = None
        if self.rank == 0:
            from ..monitor.alerts import ControlAdvice, ControlPolicy

            local = []
            if self.detector is not None:
                for alert in self.detector.update(record):
                    self.alerts.append({"rule": alert.rule, "iteration": alert.iteration, "severity": alert.severity,
                                        "confirmed": alert.confirmed, "message": alert.message})
                    print(f"[dpcc] ALERT {alert.severity} {alert.rule} @ {alert.iteration}: {alert.message}",
                          flush=True)
                    decided = ControlPolicy(self.cfg.monitor).decide(alert, self.detector.last_healthy_iteration)
                    if decided is not None:
                        local.append(decided)
            got = ControlAdvice.merge(local) if local else None
            if self.monitor is not None:
                from .control import SidecarAdvice

                if self.sidecar_advice is None:
                    self.sidecar_advice = SidecarAdvice(self.cfg.monitor, log=lambda m: print(m, flush=True))
                self.monitor.send(record)
                got = self.sidecar_advice.answer(self.monitor, record["iteration"], got)
                self.counters["advice_fallbacks"] = self.sidecar_advice.fallbacks
            if got is not None and self.cfg.monitor.acts_on(got.action):
                advice = (got.action, float(got.factor), got.to_iteration)
                print(f"[dpcc] control advice: {got.action} ({got.reason})", flush=True)
            elif got is not None and got.action != "none" and self.cfg.monitor.control_active:
                print(f"[dpcc] control advice not acted on (monitor.act_on: {self.cfg.monitor.act_on}): "
                      f"{got.action} ({got.reason})", flush=True)
        if dist.is_initialized() and self.world > 1:
            box = [advice]
            dist.broadcast_object_list(box, src=0)
            advice = box[0]
        return advice

    def rollback_to(self, to_iteration: Optional[int], controller) -> Optional[int]:
        """Load the newest kept checkpoint at or before ``to_iteration``; None when there is none.

        Weights, optimizer, schedule, DPCC controller and detector go back; the prompt stream
        keeps moving forward, so the run does not replay the batches that led to the collapse.
        """
        from ..megatron.checkpoint import load_checkpoint, retire_newer_than

        if not self.cfg.checkpoint.dir:
            return None
        self.finalize_saves(blocking=True)
        root = Path(self.cfg.checkpoint.dir)
        kept = sorted(int(p.name[5:]) for p in root.glob("iter_*") if (p / "trainer_state.json").is_file())
        eligible = [i for i in kept if to_iteration is None or i <= to_iteration]
        if not eligible:
            return None
        path = root / f"iter_{eligible[-1]:07d}"
        current = {"model": to_dict(self.cfg.model), "layout": self.layout()}
        with self._loading("rolling back to", path):
            state = load_checkpoint(path, self.chunks, self.optimizer, self.scheduler, current,
                                    extra=self._reference_in(path))
        self._fresh_optimizer_if_weights_only(state)
        controller.load_state_dict(state["controller"])
        if self.detector is not None and state.get("detector"):
            self.detector.load_state_dict(state["detector"])
        if self.monitor is not None:
            self.monitor.notify_rollback(int(state["iteration"]))
        if self.rank == 0:  # the abandoned branch's checkpoints go (see retire_newer_than)
            retire_newer_than(root, int(state["iteration"]))
        if dist.is_initialized() and self.world > 1:
            dist.barrier()
        self.counters["rollbacks"] = self.counters.get("rollbacks", 0) + 1
        if self.rank == 0:
            print(f"[dpcc] rolled back to {path}", flush=True)
        return int(state["iteration"])

    def alerts_seen(self) -> list:
        return list(self.alerts)

    def finish(self, summary: dict) -> None:
        if self.rank == 0:
            summary["records"] = len(self.records)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "metrics.jsonl", "w") as f:
                for r in self.records:
                    f.write(json.dumps(r) + "\n")
            (self.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str))
            if self.monitor is not None:
                self.monitor.close(timeout=5.0)
            if self.evaluator is not None:
                with open(self.out_dir / "eval.jsonl", "w") as f:
                    for r in self.evaluator.records:
                        f.write(json.dumps(r) + "\n")
            if self.loggers is not None:
                self.loggers.close()
        if self.engine is not None:
            self.engine.close()
        close = getattr(self.reward, "close", None)
        if close:
            close()


def setup_run(cfg: JobConfig) -> RunContext:
    from megatron.core import parallel_state as ps

    from ..launch.ranks import discover_ranks, export_torch_env
    from ..megatron.optimizer import build_training_model
    from ..megatron.parallel import data_parallel_size, init_distributed, init_model_parallel
    from ..rewards import DualTrackReward

    info = discover_ranks()
    export_torch_env(info)
    if not torch.cuda.is_available():
        from ..testing import cpu_threads, enable_cpu_megatron

        enable_cpu_megatron()
        torch.set_num_threads(cpu_threads(info.local_world_size))
    init_distributed(cfg.parallel.backend, cfg.parallel.distributed_timeout_minutes)
    dp = data_parallel_size(cfg.parallel, dist.get_world_size())
    _check_batch_layout(cfg, dp)
    torch.manual_seed(cfg.train.seed)
    init_model_parallel(cfg.parallel, seed=cfg.train.seed)

    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.stop_tokens)
    cfg = resolve_vocab_size(cfg, tokenizer)
    reward = DualTrackReward(cfg.reward)
    prompts, eval_prompts = _load_data(cfg, set(reward.base_layer.tasks))
    reward.base_layer.check_sandbox({p.fields.get("task") for p in prompts + eval_prompts})  # code: isolation or stop
    dataset = PromptDataset(prompts, seed=cfg.train.seed, shuffle=cfg.data.shuffle)

    from .loading import announce

    load_fn = None
    if cfg.checkpoint.load:
        from ..convert import load_mcore_checkpoint

        def load_fn(chunks):
            with announce("loading checkpoint.load", cfg.checkpoint.load, cfg, dp, dist.get_rank()):
                load_mcore_checkpoint(chunks, cfg.checkpoint.load, cfg.model)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision, load_fn)
    reference = None
    if cfg.loss.ref_kl_coef > 0:
        from contextlib import nullcontext

        from ..megatron.reference import ReferencePolicy

        path = cfg.loss.ref_model_path
        with (announce("loading the reference (loss.ref_model_path)", path, cfg, dp, dist.get_rank()) if path
              else nullcontext()):
            reference = ReferencePolicy.build(chunks, cfg.model, cfg.parallel, cfg.precision,
                                              path=path, offload=cfg.loss.ref_offload)

    rank = dist.get_rank()
    if rank == 0:
        p = cfg.parallel
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        print(f"[dpcc] {dist.get_world_size()} ranks from {info.launcher}: TP{p.tensor_model_parallel_size} "
              f"PP{p.pipeline_model_parallel_size} DP{dp}, {device}", flush=True)
    mp_group = ps.get_model_parallel_group()
    out_dir = Path(cfg.train.output_dir)
    ctx = RunContext(
        cfg=cfg, rank=rank, world=dist.get_world_size(), dp=dp, dp_rank=ps.get_data_parallel_rank(),
        mp_rank=dist.get_rank(mp_group), dp_group=ps.get_data_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
        mp_group=mp_group, chunks=chunks, tokenizer=tokenizer, dataset=dataset, eval_prompts=eval_prompts,
        reward=reward, vocab_size=tokenizer.vocab_size, out_dir=out_dir, reference=reference)
    if cfg.checkpoint.dir:
        from ..megatron.checkpoint import make_async_queue

        ctx.ckpt_queue = make_async_queue(cfg.checkpoint.async_save)
    from .engines import build_rollout_engine

    ctx.engine = build_rollout_engine(ctx)
    if rank == 0:
        from ..monitor.detector import CollapseDetector

        ctx.detector = CollapseDetector(cfg.monitor)
        if cfg.monitor.enabled and cfg.monitor.address:
            from ..monitor.client import MonitorClient

            ctx.monitor = MonitorClient.from_config(cfg.monitor, output_dir=str(out_dir))
        from .loggers import ExperimentLoggers

        ctx.loggers = ExperimentLoggers(cfg, out_dir, run_config=to_dict(cfg))
    from .evaluate import Evaluator

    ctx.evaluator = Evaluator(ctx)
    return ctx


def _load_data(cfg: JobConfig, known_tasks: set) -> tuple[list, list]:
    """Training and held-out prompts; every task must have reward checkers (or reward.fallback_task)."""
    from ..data.formats import check_tasks, load_prompts
    from .evaluate import load_eval_prompts

    if cfg.data.prompts:
        prompts = load_prompts(cfg.data.prompts, cfg.data.format, cfg.data.default_task)
    else:
        prompts = synthetic_prompts(cfg.data.synthetic_task, cfg.data.synthetic_digits, 4096, seed=cfg.train.seed)
    eval_prompts = load_eval_prompts(cfg)
    check_tasks(prompts + eval_prompts, known_tasks, cfg.reward.fallback_task)
    if cfg.train.warmup_sft_steps:
        from .sft import check_gold

        check_gold(cfg, prompts)
    return prompts, eval_prompts


def _check_batch_layout(cfg: JobConfig, dp: int) -> None:
    r, t = cfg.rollout, cfg.train
    samples = r.prompts_per_iteration * r.group_size
    if r.prompts_per_iteration % dp:
        raise ValueError(f"rollout.prompts_per_iteration={r.prompts_per_iteration} must be divisible by the "
                         f"data-parallel size {dp}")
    if samples % t.mini_batch_size:
        raise ValueError(f"prompts_per_iteration*group_size={samples} must be a multiple of "
                         f"train.mini_batch_size={t.mini_batch_size}")
    if t.mini_batch_size % (dp * t.micro_batch_size):
        raise ValueError(f"train.mini_batch_size={t.mini_batch_size} must be a multiple of "
                         f"data-parallel size {dp} x train.micro_batch_size={t.micro_batch_size}")
    problem = interleaving_problem(cfg, dp)
    if problem:
        raise ValueError(problem)


def interleaving_problem(cfg: JobConfig, dp: int) -> Optional[str]:
    """Why the virtual-pipeline (interleaved 1F1B) layout cannot run this batch layout, or None.

    Megatron's interleaved schedule runs micro-batches in groups of PP
    (``microbatch_group_size_per_vp_stage`` defaults to PP) and refuses a count that is not a
    multiple of PP; every chunk must hold the same number of layers."""
    p, t = cfg.parallel, cfg.train
    vpp, pp = p.virtual_pipeline_model_parallel_size, p.pipeline_model_parallel_size
    if not vpp:
        return None
    if cfg.model.num_layers % (pp * vpp):
        return (f"model.num_layers={cfg.model.num_layers} is not divisible by parallel.pipeline_model_parallel_size="
                f"{pp} x parallel.virtual_pipeline_model_parallel_size={vpp}")
    n_micro = t.mini_batch_size // max(1, dp * t.micro_batch_size)
    if n_micro % pp:
        return (f"parallel.virtual_pipeline_model_parallel_size={vpp}: the interleaved schedule needs the "
                f"micro-batches per step, train.mini_batch_size / (data-parallel size {dp} x "
                f"train.micro_batch_size) = {t.mini_batch_size} / ({dp} x {t.micro_batch_size}) = {n_micro}, "
                f"to be a multiple of parallel.pipeline_model_parallel_size={pp}; change train.mini_batch_size "
                f"or train.micro_batch_size")
    return None
