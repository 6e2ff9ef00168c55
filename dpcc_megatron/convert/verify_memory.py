"""The host memory ``convert verify`` needs, estimated from the model's shape before anything loads."""
from __future__ import annotations

PROCESS_OVERHEAD_BYTES = 512 << 20
"""Python, torch, megatron-core and transformers imported in one process: 464 MiB peak RSS measured on
the CPU build (torch 2.13, megatron-core 0.16.1), rounded up."""


def memory_need(cfg, params_dtype: str, tp: int, pp: int, batch: int, seq_len: int, ranks: int = 0) -> dict:
    """Host memory ``verify`` needs, in bytes, and how it adds up (an estimate, not a measurement).

    The Megatron ranks run first and exit before the HF model loads, so the peak is the larger of
    the two phases: the ranks hold their shards once and, while ``dist_checkpointing.load`` hands
    them over, the loaded copy once more (2x the model); the HF model is loaded once (1x). Each phase
    adds the logits (fp32, compared in fp64) and ``PROCESS_OVERHEAD_BYTES`` per process."""
    from ..launch.plan import model_shape
    from .mcore_format import DTYPES

    width = DTYPES[params_dtype].itemsize
    params = model_shape(cfg).total_params(tp)
    logits = batch * seq_len * cfg.vocab_size * (4 * 3 + 8 * 4)  # fp32 copies + fp64 diff/log-softmax
    ranks = ranks or tp * pp  # verify starts more where an expert grid needs them
    mcore = 2 * params * width + ranks * PROCESS_OVERHEAD_BYTES + logits
    hf = params * width + PROCESS_OVERHEAD_BYTES + logits
    return {"bytes": max(mcore, hf), "megatron_phase_bytes": mcore, "hf_phase_bytes": hf, "params": params,
            "dtype": params_dtype, "ranks": ranks}


def describe_need(need: dict) -> str:
    gib = float(1 << 30)
    return (f"verify needs about {need['bytes'] / gib:.1f} GiB of host memory (estimate): "
            f"{_count(need['params'])} params in {need['dtype']}; the {need['ranks']} Megatron rank(s) "
            f"{need['megatron_phase_bytes'] / gib:.1f} GiB while loading, then the HF model "
            f"{need['hf_phase_bytes'] / gib:.1f} GiB (never both at once)")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
