"""What one rank holds during a run: its place in the layout, the model and its optimizer, the data and
the reward, and the run's parts, each with one job:

* ``weights`` (:mod:`.refit`): the rollout engine and the weight version it must serve;
* ``checkpoints`` (:mod:`.checkpoints`): save, resume, rollback;
* ``exchange`` (:mod:`.monitor_exchange`): the collapse detector and the monitor sidecar's advice;
* ``evaluator`` (:mod:`.evaluate`): the held-out evaluation;
* ``loggers`` (:mod:`.loggers`): TensorBoard and wandb on rank 0.

:func:`.setup.setup_run` builds it; :func:`.finish.finish` closes it; the iteration in
:mod:`.trainer` calls each part.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import JobConfig
from ..data.prompts import PromptDataset


def _counters() -> dict:
    return {"steps_taken": 0, "steps_skipped": 0, "prompts_truncated": 0, "rollbacks": 0, "fp16_overflows": 0,
            "advice_fallbacks": 0, "sft_truncated": 0}


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
    weights: object = None
    """train.refit.EngineWeights: the rollout engine (rollout/engine.py interface) and the weight version."""
    checkpoints: object = None
    """train.checkpoints.Checkpoints: save, resume and rollback."""
    exchange: object = None
    """train.monitor_exchange.MonitorExchange: the local detector and the sidecar's advice."""
    loggers: object = None
    """ExperimentLoggers (TensorBoard, wandb) on rank 0."""
    evaluator: object = None
    """The held-out evaluation (train/evaluate.py)."""
    consumed_samples: int = 0
    counters: dict = field(default_factory=_counters)
    records: list = field(default_factory=list)
    """The iteration records (rank 0), written to metrics.jsonl at the end."""

    @property
    def engine(self):
        """The rollout engine (``weights.engine``)."""
        return None if self.weights is None else self.weights.engine

    def log0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)
