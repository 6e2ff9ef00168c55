"""Experiment loggers on rank 0: TensorBoard and (optionally) Weights & Biases.

``logger`` in the config: ``tensorboard`` (on by default) writes event files under
``train.output_dir/tensorboard``; ``wandb: true`` starts a wandb run (``wandb_mode: offline`` by
default, which needs no network; ``wandb sync`` uploads it later). wandb is an optional
dependency (``pip install 'dpcc-megatron[wandb]'``): asking for it without it installed is an
error naming the key, and nothing imports it otherwise.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional


def _numeric(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class ExperimentLoggers:
    """Scalars to every configured backend; ``log({tag: value}, step)``."""

    def __init__(self, cfg, out_dir: Path, run_config: Optional[dict] = None) -> None:
        lc = cfg.logger
        self.tb = None
        self.wandb_run = None
        if lc.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except Exception as e:  # tensorboard is a dependency, but a broken install must not stop training
                print(f"[dpcc] TensorBoard disabled (logger.tensorboard): {e}", flush=True)
        if lc.wandb:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("logger.wandb is true but wandb is not installed: "
                                   "pip install 'dpcc-megatron[wandb]' (or set logger.wandb: false)") from None
            wdir = Path(lc.wandb_dir or out_dir)
            wdir.mkdir(parents=True, exist_ok=True)
            self.wandb_run = wandb.init(project=lc.wandb_project, name=lc.wandb_name, mode=lc.wandb_mode,
                                        dir=str(wdir), config=run_config or {},
                                        settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, metrics: dict, step: int) -> None:
        values = _numeric(metrics)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb_run is not None and values:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
