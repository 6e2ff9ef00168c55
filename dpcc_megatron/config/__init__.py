"""One typed config tree for a DPCC job, loaded from YAML and validated at load.

    cfg = load_config("examples/tiny_cpu.yaml", overrides=["optim.lr=1e-4"])

Errors name the key: ``loss.dpcc.tau_min must be > 1, got 0.9``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from .algo import LossConfig
from .base import ConfigError, check, from_dict, to_dict, validate_tree, apply_override
from .model import ModelConfig, ParallelConfig, PrecisionConfig
from .monitor import MonitorConfig
from .reward import RewardConfig
from .train import (CheckpointConfig, DataConfig, EvalConfig, LoggerConfig, OptimizerConfig, RolloutConfig,
                    TrainConfig)


@dataclass
class JobConfig:
    """Root of the config tree; each field is one YAML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP/PP/VPP layout; DP is the remainder of the world size."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Training precision and FP8."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and tokenizer."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss and the DPCC controller."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Dual-track reward."""
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Metrics sidecar and collapse detector."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The RL loop."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment loggers (TensorBoard, wandb)."""

    def _validate_vllm_layout(self) -> None:
        problem = _vllm_layout_problem(self)
        check(problem is None, "rollout.vllm.tensor_parallel_size", problem or "")

    def validate(self) -> None:
        """Checks that span sections."""
        # TIS scales each token's advantage, which equals weighting its loss only for losses that are
        # positively homogeneous in A; the covariance-selected losses are not.
        check(self.precision.tis_cap is None or self.loss.name not in ("clip_cov", "kl_cov"), "precision.tis_cap",
              f"cannot be combined with loss.name={self.loss.name!r} (its token selection and |log r| penalty "
              "do not scale with the advantage); unset one of them")
        from .model import moe_layout_checks

        moe_layout_checks(self.model, self.parallel)
        check(not self.precision.transformer_engine or (self.model.num_moe_experts is None
                                                        and not self.model.qk_layernorm),
              "precision.transformer_engine", "cannot be combined with model.num_moe_experts or "
              "model.qk_layernorm yet: those models are built with Megatron-Core's local spec only")
        replay = self.rollout.routing_replay
        check(not replay or self.model.num_moe_experts is not None, "rollout.routing_replay",
              "needs a mixture-of-experts model (model.num_moe_experts)")
        check(not replay or self.parallel.recompute_granularity != "full", "rollout.routing_replay",
              "cannot be combined with parallel.recompute_granularity: full (recomputed routers would replay "
              "another micro-batch's experts)")
        check(not replay or self.train.max_tokens_per_micro_batch == 0, "rollout.routing_replay",
              "needs train.max_tokens_per_micro_batch: 0 (routing is recorded per fixed-size micro-batch)")
        check(self.loss.behaviour_is_cap is None or self.precision.tis_cap is None, "loss.behaviour_is_cap",
              "and precision.tis_cap are the same importance weight (pi_prox / pi_sampler); set one of them")
        off_policy = self.loss.behaviour_is_cap is not None or self.rollout.max_staleness >= 1
        check(not off_policy or self.loss.name not in ("clip_cov", "kl_cov"), "rollout.max_staleness",
              f"(or loss.behaviour_is_cap) needs the behaviour importance weight, which loss.name="
              f"{self.loss.name!r} cannot carry (its token selection does not scale with the advantage)")
        if self.rollout.engine == "vllm":
            self._validate_vllm_layout()
        budget = self.train.max_tokens_per_micro_batch
        check(budget == 0 or not self.parallel.virtual_pipeline_model_parallel_size, "train.max_tokens_per_micro_batch",
              "must be 0 with parallel.virtual_pipeline_model_parallel_size: the interleaved schedule needs "
              "micro-batches of one shape")
        longest = self.data.max_prompt_len + self.rollout.max_new_tokens
        check(budget == 0 or budget >= longest, "train.max_tokens_per_micro_batch",
              f"must be 0 or hold one sequence of up to data.max_prompt_len + rollout.max_new_tokens = {longest} "
              f"tokens, got {budget}")


def _vllm_layout_problem(cfg: "JobConfig") -> Optional[str]:
    """Why ``rollout.vllm.tensor_parallel_size`` cannot serve this model at this layout (None when it can)."""
    mp = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    w = cfg.rollout.vllm.tensor_parallel_size or mp
    heads = cfg.model.num_attention_heads
    groups = cfg.model.num_query_groups or heads
    if w > mp or mp % w:
        return (f"must divide the model-parallel group's size TP x PP = {mp} (one vLLM worker per trainer "
                f"device of a replica), got {w}")
    if heads % w or (groups % w and w % groups):
        return (f"must divide model.num_attention_heads ({heads}) and divide or be a multiple of "
                f"model.num_query_groups ({groups}; vLLM replicates K/V heads beyond it), got {w}")
    width = cfg.model.moe_ffn_hidden_size or cfg.model.ffn_hidden_size
    if cfg.model.num_moe_experts is not None and width and width % w:
        return f"must divide model.moe_ffn_hidden_size ({width}; vLLM splits every expert over its workers), got {w}"
    return None


def load_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Load YAML at ``path`` (or the defaults), apply ``key.path=value`` overrides, validate."""
    import yaml

    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    for assignment in overrides:
        apply_override(data, assignment)
    return from_dict(JobConfig, data)


__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "JobConfig", "LoggerConfig", "LossConfig", "ModelConfig",
    "MonitorConfig", "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "RewardConfig",
    "RolloutConfig", "TrainConfig", "check", "from_dict", "load_config", "to_dict", "validate_tree",
]
