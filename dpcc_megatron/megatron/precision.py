"""Precision checks, Transformer Engine layer specs and FP8 recipes, and the sampler/trainer
mismatch statistics with the truncated importance-sampling (TIS) weight.

Who enters the FP8 context. Megatron-Core's ``TransformerBlock`` wraps its layers in TE's
autocast itself when ``TransformerConfig.fp8`` is set, so the model needs only the fields of
:func:`fp8_transformer_fields`. :func:`te_autocast` is for TE modules run outside a block (the
GPU check's FP8 smoke test); it bridges TE 2.x's rename of ``fp8_autocast(fp8_recipe=...)`` to
``autocast(recipe=...)``.

Importing this module needs torch only; Megatron and TE are imported where used.
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Optional

import torch

from ..config import ConfigError, PrecisionConfig

# FP8 GEMMs need Ada/Hopper (8.9+); MXFP8 block scaling needs Blackwell (10.0+).
FP8_MIN_CAPABILITY = (8, 9)
MXFP8_MIN_CAPABILITY = (10, 0)
BF16_MIN_CAPABILITY = (8, 0)
# Our recipe names -> Megatron-Core's ``TransformerConfig.fp8_recipe`` values.
MEGATRON_FP8_RECIPES = {"delayed": "delayed", "current": "tensorwise", "mxfp8": "mxfp8"}


def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"precision.{key} {msg}")


def validate_precision(cfg: PrecisionConfig, *, te_available: bool,
                       device_capability: Optional[tuple[int, int]]) -> None:
    """Refuse precision settings this environment cannot run; errors name the key.

    ``device_capability`` is the CUDA compute capability, or None on CPU (CPU runs have no FP8
    and no Transformer Engine; bf16/fp16 run through torch's CPU kernels).
    """
    if cfg.fp8 is not None and cfg.params_dtype != "bf16":
        _fail("fp8", f"requires params_dtype bf16 (FP8 GEMMs with bf16 weights), got {cfg.params_dtype}")
    if cfg.fp8 is not None and not cfg.transformer_engine:
        _fail("fp8", "requires precision.transformer_engine: true (FP8 runs only through Transformer Engine)")
    if cfg.transformer_engine and not te_available:
        key = "fp8" if cfg.fp8 is not None else "transformer_engine"
        _fail(key, "needs Transformer Engine, which is not installed (pip install 'dpcc-megatron[gpu]')")
    if cfg.transformer_engine and device_capability is None:
        _fail("transformer_engine", "needs a CUDA GPU; this run has none")
    if cfg.fp8 is not None:
        need = MXFP8_MIN_CAPABILITY if cfg.fp8 == "mxfp8" else FP8_MIN_CAPABILITY
        if tuple(device_capability) < need:
            _fail("fp8", f"{cfg.fp8!r} needs compute capability >= {need[0]}.{need[1]}, "
                         f"this GPU has {device_capability[0]}.{device_capability[1]}")
    if cfg.params_dtype == "bf16" and device_capability is not None and tuple(device_capability) < BF16_MIN_CAPABILITY:
        _fail("params_dtype", f"bf16 needs compute capability >= 8.0, this GPU has "
                              f"{device_capability[0]}.{device_capability[1]}; use fp16 with loss scaling")


def te_version() -> Optional[str]:
    """Installed Transformer Engine version, or None."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken TE build (missing CUDA libs) counts as absent
        return None
    try:
        from importlib.metadata import version

        return version("transformer_engine")
    except Exception:
        return getattr(transformer_engine, "__version__", "unknown")


def device_capability() -> Optional[tuple[int, int]]:
    """Compute capability of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def check_precision_environment(cfg: PrecisionConfig) -> None:
    """:func:`validate_precision` against the installed TE and the current GPU."""
    te = cfg.transformer_engine and te_version() is not None  # importing TE is slow: only when asked for
    validate_precision(cfg, te_available=te, device_capability=device_capability())


def fp8_transformer_fields(cfg: PrecisionConfig) -> dict:
    """``TransformerConfig`` keyword arguments for FP8 (empty when FP8 is off)."""
    if cfg.fp8 is None:
        return {}
    return dict(fp8=cfg.fp8_format, fp8_recipe=MEGATRON_FP8_RECIPES[cfg.fp8], fp8_margin=cfg.fp8_margin,
                fp8_amax_history_len=cfg.fp8_amax_history_len, fp8_amax_compute_algo=cfg.fp8_amax_compute_algo)


def te_layer_spec():
    """Megatron's Transformer Engine GPT layer spec (fused norm+linear, TE attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def build_fp8_recipe(cfg: PrecisionConfig, recipe_module=None):
    """The TE recipe object of ``cfg.fp8`` (None when FP8 is off).

    ``recipe_module`` defaults to ``transformer_engine.common.recipe``.
    """
    if cfg.fp8 is None:
        return None
    if recipe_module is None:
        from transformer_engine.common import recipe as recipe_module
    fmt = recipe_module.Format.HYBRID if cfg.fp8_format == "hybrid" else recipe_module.Format.E4M3
    if cfg.fp8 == "delayed":
        return recipe_module.DelayedScaling(fp8_format=fmt, margin=cfg.fp8_margin,
                                            amax_history_len=cfg.fp8_amax_history_len,
                                            amax_compute_algo=cfg.fp8_amax_compute_algo)
    if cfg.fp8 == "current":
        if not hasattr(recipe_module, "Float8CurrentScaling"):
            _fail("fp8", "'current' needs Transformer Engine >= 2.2 (Float8CurrentScaling)")
        return recipe_module.Float8CurrentScaling(fp8_format=fmt)
    if not hasattr(recipe_module, "MXFP8BlockScaling"):
        _fail("fp8", "'mxfp8' needs Transformer Engine >= 2.0 (MXFP8BlockScaling)")
    return recipe_module.MXFP8BlockScaling(fp8_format=fmt)


def te_autocast_api(te_pytorch) -> str:
    """Which quantised-autocast API ``transformer_engine.pytorch`` offers: ``"autocast"`` (newer
    TE 2.x, ``autocast(recipe=)``) or ``"fp8_autocast"`` (older, ``fp8_autocast(fp8_recipe=)``)."""
    fn = getattr(te_pytorch, "autocast", None)
    if fn is not None and "recipe" in inspect.signature(fn).parameters:
        return "autocast"
    if getattr(te_pytorch, "fp8_autocast", None) is not None:
        return "fp8_autocast"
    raise RuntimeError("this Transformer Engine has neither autocast(recipe=...) nor fp8_autocast()")


def te_autocast(enabled: bool, recipe=None, te_pytorch=None):
    """TE's quantised-autocast context under either API (see :func:`te_autocast_api`).
    ``enabled=False`` needs no TE at all."""
    if not enabled:
        return nullcontext()
    if te_pytorch is None:
        import transformer_engine.pytorch as te_pytorch
    if te_autocast_api(te_pytorch) == "autocast":
        return te_pytorch.autocast(enabled=True, recipe=recipe)
    return te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe)


@torch.no_grad()
def tis_weights(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """Per-token truncated IS weight sg(min(pi_trainer / pi_sampler, cap)), fp32; 0 where masked.

    ``trainer_logprobs`` are the trainer's recomputed old-policy log-probs, ``sampler_logprobs``
    the rollout engine's, both [B, T] on the sampled tokens.
    """
    mask = mask.bool()
    log_w = torch.where(mask, trainer_logprobs.float() - sampler_logprobs.float(), 0.0)
    return torch.where(mask, torch.exp(log_w).clamp(max=cap), 0.0)


@torch.no_grad()
def mismatch_stats(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                   cap: Optional[float] = None) -> dict[str, float]:
    """Sampler/trainer mismatch on the sampled tokens, separate from policy drift.

    ``mismatch_kl``: k3 estimate of KL(sampler || trainer); ``is_weight_*``: statistics of
    w = pi_trainer / pi_sampler (mean 1 and no spread when they agree); ``is_ess_frac``: effective
    sample size (sum w)^2 / (n sum w^2) over n tokens; ``tis_clip_frac``: tokens with w > cap.
    """
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return {"mismatch_kl": 0.0, "is_weight_mean": 1.0, "is_weight_max": 1.0, "is_weight_min": 1.0,
                "is_ess_frac": 1.0, "tis_clip_frac": 0.0}
    log_w = (trainer_logprobs.float() - sampler_logprobs.float())[mask]  # log pi_trainer - log pi_sampler
    if not bool(torch.isfinite(log_w).all()):
        raise ValueError("mismatch_stats: non-finite log-probs on valid tokens")
    w = torch.exp(log_w)
    out = {
        "mismatch_kl": float((w - 1 - log_w).mean()),  # k3 with samples from the sampler
        "is_weight_mean": float(w.mean()),
        "is_weight_max": float(w.max()),
        "is_weight_min": float(w.min()),
        "is_ess_frac": float(w.sum() ** 2 / (n * (w * w).sum())),
        "tis_clip_frac": float((w > cap).float().mean()) if cap is not None else 0.0,
    }
    return out


__all__ = ["FP8_MIN_CAPABILITY", "MEGATRON_FP8_RECIPES", "MXFP8_MIN_CAPABILITY", "build_fp8_recipe",
           "check_precision_environment", "device_capability", "fp8_transformer_fields", "mismatch_stats",
           "te_autocast", "te_autocast_api", "te_layer_spec", "te_version", "tis_weights", "validate_precision"]
