"""Tiny model configs and deterministic batches shared by tests, the demo and CPU benchmarks."""
from __future__ import annotations

import torch

from ..config import ModelConfig, ParallelConfig


def tiny_model_config(**overrides) -> ModelConfig:
    """4 layers (so PP=2 has 2 per stage), GQA with 2 groups (so TP=2 splits groups)."""
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, vocab_size=256, make_vocab_size_divisible_by=128, max_seq_len=64)
    base.update(overrides)
    return ModelConfig(**base)


def parallel_config(tp: int = 1, pp: int = 1, **overrides) -> ParallelConfig:
    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          use_distributed_optimizer=overrides.pop("use_distributed_optimizer", False), **overrides)


def random_tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
