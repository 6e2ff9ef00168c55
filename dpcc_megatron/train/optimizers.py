"""The run's optimizers: the warm-start's and RL's (Megatron's distributed optimizer and its schedule)."""
from __future__ import annotations

import dataclasses
from typing import Optional


def total_optimizer_steps(cfg) -> int:
    """The run's optimizer steps (the LR schedule's length; the DPCC early phase and the loop read it too)."""
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    return max(1, cfg.train.iterations * cfg.train.inner_epochs * (samples // cfg.train.mini_batch_size))


def build_optimizer(ctx, lr: Optional[float] = None):
    """An optimizer over the run's model (``lr``: another constant LR, as the warm-start uses)."""
    from ..megatron.optimizer import build_optimizer as build

    optim = ctx.cfg.optim if lr is None else dataclasses.replace(ctx.cfg.optim, lr=lr, min_lr=0.0)
    return build(ctx.chunks, optim, ctx.cfg.parallel, ctx.cfg.precision)


def build_rl_optimizer(ctx, total_steps: int) -> None:
    """RL's optimizer and LR schedule over ``total_steps`` optimizer steps, as ``ctx.optimizer`` / ``ctx.scheduler``."""
    from ..megatron.optimizer import build_scheduler

    ctx.optimizer = build_optimizer(ctx)
    ctx.scheduler = build_scheduler(ctx.optimizer, ctx.cfg.optim, total_steps)
