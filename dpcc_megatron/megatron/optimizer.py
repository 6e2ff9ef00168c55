"""Megatron DDP, optimizer and LR schedule, plus the drift-aware LR hook.

The DPCC LR factor is applied around exactly one ``optimizer.step()``:

    scheduled = group["lr"]            # what OptimizerParamScheduler set (incl. per-group multipliers)
    group["lr"] = scheduled * factor   # this step only
    optimizer.step()
    group["lr"] = scheduled            # the schedule is never overwritten, so factors never compound

This works for every Megatron optimizer (fp32, mixed precision, distributed,
``ChainedOptimizer``) because they all expose the inner torch optimizers' param
group dicts through ``param_groups``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..config import OptimizerConfig, ParallelConfig, PrecisionConfig
from ..distributed import any_rank


def wrap_ddp(chunks, transformer_config, parallel: ParallelConfig):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from .performance import ddp_config_kwargs, resolve

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=parallel.use_distributed_optimizer,
        **ddp_config_kwargs(resolve(parallel)))  # overlap_grad_reduce / overlap_param_gather per machine
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=i > 0))
    return wrapped


def build_optimizer(chunks, optim: OptimizerConfig, parallel: ParallelConfig, precision: PrecisionConfig):
    from megatron.core.optimizer import OptimizerConfig as MOptConfig
    from megatron.core.optimizer import get_megatron_optimizer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision.params_dtype]
    kwargs = dict(
        optimizer=optim.name, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, bf16=precision.params_dtype == "bf16", fp16=precision.params_dtype == "fp16",
        params_dtype=dtype, use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    if precision.params_dtype == "fp16":
        kwargs.update(initial_loss_scale=precision.initial_loss_scale, min_loss_scale=precision.min_loss_scale,
                      loss_scale_window=precision.loss_scale_window, hysteresis=precision.loss_scale_hysteresis)
    optimizer = get_megatron_optimizer(MOptConfig(**kwargs), chunks)
    if precision.params_dtype == "fp16":
        # The schedule multiplies each micro-batch loss by the current loss scale before backward
        # (Megatron's training loop sets this hook; without it the optimizer's unscale would
        # shrink every gradient by the scale).
        for chunk in chunks:
            getattr(chunk, "module", chunk).config.grad_scale_func = optimizer.scale_loss
    return optimizer


def grad_scaler(optimizer):
    """The fp16 dynamic loss scaler of a Megatron optimizer (None for fp32/bf16). Megatron's fp16
    optimizer itself detects inf/NaN gradients, skips the step and lowers the scale."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            return scaler
    return None


def build_scheduler(optimizer, optim: OptimizerConfig, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = optim.lr_warmup_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(total_steps, warmup + 1), lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant")


@contextmanager
def scaled_lr(optimizer, factor: float) -> Iterator[list[float]]:
    """Multiply every param group's scheduled LR by ``factor`` for the duration of one step."""
    groups = optimizer.param_groups
    scheduled = [g["lr"] for g in groups]
    for g, lr in zip(groups, scheduled):
        g["lr"] = lr * factor
    try:
        yield scheduled
    finally:
        for g, lr in zip(groups, scheduled):
            g["lr"] = lr


def grads_are_finite(chunks, group=None) -> bool:
    """True when every rank's gradients are finite (all-reduced, so all ranks agree on skipping)."""
    bad = torch.zeros(1)
    for chunk in chunks:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None and not torch.isfinite(g).all():
                bad.fill_(1.0)
                break
    return not any_rank(bool(bad.item()), group)


def zero_grads(chunks, optimizer) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    optimizer.zero_grad()


def build_training_model(model_cfg, parallel: ParallelConfig, precision: PrecisionConfig, load_fn=None):
    """Model chunk(s) of this rank, optionally filled by ``load_fn(chunks)``, wrapped in Megatron DDP
    with the schedule hooks set (gradient finalisation across DP, tied embeddings across PP).

    With ``parallel.virtual_pipeline_model_parallel_size`` = v, one chunk per virtual stage
    (``vp_stage`` 0..v-1): chunk i holds layers ``(i * pp + pp_rank) * n .. + n`` with
    n = num_layers / (pp * v), as Megatron's interleaved schedule expects."""
    from megatron.core.distributed import finalize_model_grads

    from .model import build_gpt_model

    vpp = parallel.virtual_pipeline_model_parallel_size
    stages = list(range(vpp)) if vpp else [None]
    chunks = [build_gpt_model(model_cfg, parallel, precision, vp_stage=v) for v in stages]
    if load_fn is not None:
        load_fn(chunks)
    chunks = wrap_ddp(chunks, chunks[0].config, parallel)
    no_sync = [c.no_sync for c in chunks]
    for chunk in chunks:  # the schedules read model[0]'s config; keep every chunk's consistent
        tcfg = chunk.config
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return chunks
