"""Build the rollout engine ``rollout.engine`` names, for a run's context (see dpcc_megatron/rollout/engine.py)."""
from __future__ import annotations

import dataclasses
import functools
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
                              tp_group=ctx.tp_group, pp_group=ctx.pp_group, batch_size=cfg.rollout.batch_size)
    if cfg.rollout.engine == "vllm":
        return build_vllm_engine(ctx.chunks, cfg.model, cfg.precision.params_dtype, vocab_size=ctx.vocab_size,
                                 eos_id=ctx.tokenizer.eos_id, model_dir=Path(ctx.out_dir) / f"vllm_model_dp{ctx.dp_rank}",
                                 host=ctx.mp_rank == 0, tp_group=ctx.tp_group, pp_group=ctx.pp_group,
                                 mp_group=ctx.mp_group, seed=cfg.train.seed)
    raise EngineStartError(f"rollout.engine: unknown engine {cfg.rollout.engine!r}")


def build_vllm_engine(chunks, model_cfg, params_dtype: str, *, vocab_size: int, eos_id, model_dir, host: bool,
                      tp_group=None, pp_group=None, mp_group=None, seed: int = 0):
    """A :class:`~dpcc_megatron.rollout.vllm_engine.VLLMEngine` started on the current weights of ``chunks``.

    The host writes ``model_dir`` once (config.json from the model config, model.safetensors of the
    gathered weights); later refits are in memory."""
    from ..convert.errors import ConversionError
    from ..convert.hf_config import hf_config_from_model
    from ..convert.layout import all_hf_shapes
    from ..megatron.weight_export import gather_hf_weights
    from ..rollout.vllm_engine import VLLMEngine, agree_error

    served = dataclasses.replace(model_cfg, vocab_size=vocab_size)
    try:
        hf = hf_config_from_model(served, params_dtype)
    except ConversionError as e:
        raise EngineStartError(f"rollout.engine: vllm cannot serve this model: {e}") from None
    if eos_id is not None:
        hf["eos_token_id"] = int(eos_id)
    exporter = functools.partial(gather_hf_weights, model_cfg=model_cfg, vocab_size=vocab_size,
                                 dtype=_TORCH_DTYPES[params_dtype], tp_group=tp_group, pp_group=pp_group)
    expected = {n: tuple(s) for n, s in all_hf_shapes(served)}
    pairs = exporter(chunks)
    error = None
    if host:
        try:
            _write_model_dir(Path(model_dir), hf, pairs, expected)
        except Exception as e:
            error = str(e) if isinstance(e, EngineStartError) else f"rollout.engine: vllm: writing {model_dir}: {e}"
    error = agree_error(error)
    if error is not None:
        raise EngineStartError(error)
    return VLLMEngine(model_dir=str(model_dir), exporter=exporter, expected_shapes=expected, host=host,
                      mp_group=mp_group, dtype=_VLLM_DTYPES[params_dtype], max_model_len=model_cfg.max_seq_len,
                      seed=seed, vocab_size=vocab_size)


def _write_model_dir(model_dir: Path, hf: dict, pairs, expected: dict) -> None:
    from safetensors.torch import save_file

    got = {n: tuple(t.shape) for n, t in pairs}
    if got != expected:
        bad = sorted(set(got) ^ set(expected)) + [n for n in got if n in expected and got[n] != expected[n]]
        raise EngineStartError(f"rollout.engine: vllm: the model's weights do not match the model config "
                               f"(first differences: {bad[:5]})")
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf, indent=1))
    save_file(dict(pairs), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
