"""Set-up of a run: ranks and process groups, data and reward, the model, the reference, the rollout
engine, the monitor's detector and client, the loggers: everything :class:`.context.RunContext` holds.
The optimizers are built later (:mod:`.optimizers`), after the warm-start or a resume."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..config import JobConfig, to_dict
from ..data.prompts import PromptDataset, synthetic_prompts
from ..data.tokenizer import build_tokenizer, resolve_vocab_size
from .checkpoints import Checkpoints
from .context import RunContext
from .engines import build_rollout_engine
from .evaluate import Evaluator, load_eval_prompts
from .finish import close
from .loading import announce
from .monitor_exchange import MonitorExchange
from .refit import EngineWeights


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
    check_batch_layout(cfg, dp)
    torch.manual_seed(cfg.train.seed)
    init_model_parallel(cfg.parallel, seed=cfg.train.seed)

    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.stop_tokens)
    cfg = resolve_vocab_size(cfg, tokenizer)
    reward = DualTrackReward(cfg.reward)
    prompts, eval_prompts = load_data(cfg, set(reward.base_layer.tasks))
    reward.base_layer.check_sandbox({p.fields.get("task") for p in prompts + eval_prompts})  # code: isolation or stop
    dataset = PromptDataset(prompts, seed=cfg.train.seed, shuffle=cfg.data.shuffle)

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
    ctx.checkpoints = Checkpoints(ctx)  # with checkpoint.async_save, its queue
    ctx.weights = EngineWeights(build_rollout_engine(ctx), chunks, rank=rank)
    try:
        _monitoring(ctx)
        ctx.evaluator = Evaluator(ctx)
    except BaseException:
        close(ctx)  # the engine (and the sidecar client) do not outlive a set-up that failed
        raise
    return ctx


def _monitoring(ctx: RunContext) -> None:
    """The monitor exchange (rank 0: the local detector, the sidecar client) and the experiment loggers."""
    ctx.exchange = MonitorExchange(ctx.cfg, ctx.rank, ctx.world, ctx.counters)
    if ctx.rank != 0:
        return
    from ..monitor.detector import CollapseDetector
    from .loggers import ExperimentLoggers

    cfg = ctx.cfg
    ctx.exchange.detector = CollapseDetector(cfg.monitor)
    if cfg.monitor.enabled and cfg.monitor.address:
        from ..monitor.client import MonitorClient

        ctx.exchange.monitor = MonitorClient.from_config(cfg.monitor, output_dir=str(ctx.out_dir))
    ctx.loggers = ExperimentLoggers(cfg, ctx.out_dir, run_config=to_dict(cfg))


def load_data(cfg: JobConfig, known_tasks: set) -> tuple[list, list]:
    """Training and held-out prompts; every task must have reward checkers (or reward.fallback_task)."""
    from ..data.formats import check_tasks, load_prompts

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


def check_batch_layout(cfg: JobConfig, dp: int) -> None:
    """Refuse a batch layout the data-parallel size or the pipeline schedule cannot run, naming the keys."""
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
