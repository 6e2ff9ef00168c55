"""Megatron-style console line, and the record to the experiment loggers (rank 0)."""
from __future__ import annotations

import math
import sys

from .timing import console_fields


def _fmt(x, spec=".4f") -> str:
    try:
        return "nan" if math.isnan(float(x)) else format(float(x), spec)
    except (TypeError, ValueError):
        return str(x)


class ConsoleLogger:
    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.bar = None
        if ctx.rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=ctx.cfg.train.iterations, desc="dpcc", leave=False)

    def line(self, r: dict) -> None:
        ctx = self.ctx
        if ctx.rank == 0:
            ctx.records.append(r)
        if ctx.rank != 0 or r["iteration"] % ctx.cfg.train.log_interval:
            return
        total = ctx.cfg.train.iterations
        msg = (f" iteration {r['iteration'] + 1:6d}/{total:6d} | consumed samples: {r['consumed_samples']:8d} | "
               f"reward: {_fmt(r['reward_mean'])} | base: {_fmt(r.get('reward_base_mean'))} | "
               f"kl({r['kl_estimator']}): {_fmt(r['kl_old_new'], '.5f')} | "
               + (f"drift kl: {_fmt(r['kl_probe'], '.5f')} | " if "kl_probe" in r else "")
               + f"entropy: {_fmt(r.get('entropy'))} | "
               + (f"tau: {_fmt(r['tau'], '.3f')} | " if "tau" in r else "")  # DPCC's tau_t; baselines clip at a constant
               + f"lr: {_fmt(r['lr'], '.3e')} | lr factor: {_fmt(r['lr_factor'], '.3f')} | "
               f"grad norm: {_fmt(r['grad_norm'])} | clip frac: {_fmt(r['clip_frac'])} | "
               f"sample util: {_fmt(r['sample_utilization'])} | s/iter: {_fmt(r['seconds'], '.2f')} | "
               f"tokens/s: {_fmt(r['tokens_per_s'], '.0f')}"
               + (f" | {console_fields(r)}" if "time_rollout_s" in r else ""))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(msg)
        else:
            print(msg, flush=True)
        if ctx.loggers is not None:
            ctx.loggers.log({k if "/" in k else f"train/{k}": v for k, v in r.items() if k != "iteration"},
                            r["iteration"])
