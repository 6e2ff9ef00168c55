"""Checks and casts applied to every tensor that crosses a format boundary."""
from __future__ import annotations

import torch

from .errors import ConversionError

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CHUNK = 1 << 24  # elements per finiteness check: bounds the temporary to ~16 MB


def _all_finite(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(c).all()) for c in flat.split(_CHUNK))


def checked_cast(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``t`` in ``dtype``; refuses non-float sources, NaN/Inf, and values the target cannot hold."""
    if t.dtype not in _FLOATS:
        raise ConversionError(f"{name} has dtype {t.dtype}, which cannot be represented as a float weight "
                              "(quantized checkpoints are not supported)")
    if not _all_finite(t):
        raise ConversionError(f"{name} contains NaN or Inf")
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if not _all_finite(out):
        peak = max(float(c.abs().max()) for c in t.reshape(-1).split(_CHUNK))
        raise ConversionError(f"{name} has values up to {peak:.4g}, which overflow {dtype} "
                              f"(max {torch.finfo(dtype).max:.4g}); choose a wider --dtype")
    return out


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Megatron's vocabulary padding: zero rows appended up to ``rows``."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ConversionError(f"vocabulary of {t.shape[0]} rows does not fit the padded size {rows}")
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
