"""Build the rollout engine ``rollout.engine`` names, for a run's context (see dpcc_megatron/rollout/engine.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..rollout.engine import EngineStartError

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_rollout_engine(ctx):
    """Every rank calls it (the vLLM engine's construction is collective); errors name ``rollout.engine``."""
    cfg = ctx.cfg
    if cfg.rollout.engine == "megatron":
        from ..megatron.megatron_engine import MegatronEngine

        return MegatronEngine(ctx.chunks, vocab_size=ctx.vocab_size, pad_id=ctx.tokenizer.pad_id,
                              tp_group=ctx.tp_group, pp_group=ctx.pp_group, batch_size=cfg.rollout.batch_size,
                              record_routing=cfg.rollout.routing_replay)  # MoE: the sampler's routing, replayed
    if cfg.rollout.engine == "vllm":
        v = cfg.rollout.vllm
        return build_vllm_engine(ctx.chunks, cfg.model, cfg.precision.params_dtype, vocab_size=ctx.vocab_size,
                                 eos_id=ctx.tokenizer.eos_id, host=ctx.mp_rank == 0, tp_group=ctx.tp_group,
                                 pp_group=ctx.pp_group, mp_group=ctx.mp_group, seed=cfg.train.seed,
                                 workers=v.tensor_parallel_size or cfg.parallel.tensor_model_parallel_size
                                 * cfg.parallel.pipeline_model_parallel_size,
                                 bucket_mb=v.refit_bucket_mb, shm_dir=v.shm_dir,
                                 gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
                                 sleep_level=v.sleep_level, allow_untested_version=v.allow_untested_version)
    raise EngineStartError(f"rollout.engine: unknown engine {cfg.rollout.engine!r}")


def build_vllm_engine(chunks, model_cfg, params_dtype: str, *, vocab_size: int, eos_id, host: bool,
                      tp_group=None, pp_group=None, mp_group=None, seed: int = 0, workers: int = 1,
                      bucket_mb: float = 512.0, shm_dir: str = "/dev/shm", **engine_kw):
    """A :class:`~dpcc_megatron.rollout.vllm_engine.VLLMEngine` of ``workers`` tensor-parallel workers,
    started from a temporary directory holding only the model's config.json (removed once vLLM read it).
    It serves no weights until its first refit (``engine.refit_if_stale(chunks, version)``)."""
    import tempfile

    from ..convert.errors import ConversionError
    from ..convert.hf_config import hf_config_from_model
    from ..megatron.weight_export import HFWeightStream
    from ..rollout.vllm_engine import VLLMEngine

    served = dataclasses.replace(model_cfg, vocab_size=vocab_size)
    try:
        hf = hf_config_from_model(served, params_dtype)
    except ConversionError as e:
        raise EngineStartError(f"rollout.engine: vllm cannot serve this model: {e}") from None
    if eos_id is not None:
        hf["eos_token_id"] = int(eos_id)
    stream = HFWeightStream(model_cfg, vocab_size=vocab_size, dtype=_TORCH_DTYPES[params_dtype],
                            bucket_bytes=int(bucket_mb * 2**20), tp_group=tp_group, pp_group=pp_group)
    stream.plan(chunks)  # collective: which pipeline stage owns which layer
    model_dir = None
    if host:
        model_dir = tempfile.mkdtemp(prefix="dpcc-vllm-model-")
        (Path(model_dir) / "config.json").write_text(json.dumps(hf, indent=1))
    return VLLMEngine(model_dir=model_dir, stream=stream, host=host, mp_group=mp_group, workers=workers,
                      dtype=_VLLM_DTYPES[params_dtype], max_model_len=model_cfg.max_seq_len, seed=seed,
                      vocab_size=vocab_size, shm_dir=shm_dir, **engine_kw)
