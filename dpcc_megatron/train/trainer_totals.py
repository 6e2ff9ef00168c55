"""Run-length arithmetic shared by the loop, the LR schedule and the DPCC early phase."""
from __future__ import annotations

from ..config import JobConfig


def total_optimizer_steps(cfg: JobConfig) -> int:
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    return max(1, cfg.train.iterations * cfg.train.inner_epochs * (samples // cfg.train.mini_batch_size))
