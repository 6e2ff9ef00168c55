"""GPU-side speed settings: resolve ``auto`` per machine, refuse what cannot run, wire them up.

The keys (``parallel.gradient_accumulation_fusion``, ``parallel.overlap_grad_reduce``,
``parallel.overlap_param_gather``, ``parallel.deallocate_pipeline_outputs``,
``train.release_memory_between_phases``) accept ``auto``, ``true`` or ``false``. ``auto`` is on
where the machine and megatron-core support the feature and off elsewhere (all off on CPU);
an explicit ``true`` that cannot run raises :class:`~dpcc_megatron.config.ConfigError` naming the
key, before the model is built. :func:`resolve` is pure (the machine comes in as
:class:`Hardware`), so the rules are tested without a GPU.

What megatron-core (0.16 - 0.19) needs, and where it is wired:

* ``gradient_accumulation_fusion`` -> ``TransformerConfig``. Megatron's ``ColumnParallelLinear`` /
  ``RowParallelLinear`` raise at construction without apex's ``fused_weight_gradient_mlp_cuda``;
  the GPT output layer is such a layer even with the Transformer Engine spec, so the extension is
  required in every case (NGC PyTorch containers ship it). Needs Megatron DDP's ``main_grad``
  buffers, which this project always uses.
* ``overlap_grad_reduce`` / ``overlap_param_gather`` -> ``DistributedDataParallelConfig``. The
  param gather overlap only exists with the distributed optimizer (DDP registers its forward
  pre-hooks only then) and, as in Megatron-LM, only together with the grad-reduce overlap.
  After an optimizer step the parameters are gathered lazily by the next forward; the trainer
  calls :func:`gather_params` after each update phase so that generation, evaluation and the
  checkpoint see the updated weights in full.
* ``deallocate_pipeline_outputs`` -> ``TransformerConfig``, read by the pipeline schedules.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Optional

from ..config import ConfigError


@dataclass(frozen=True)
class Hardware:
    cuda: bool
    """A CUDA device is available."""
    fused_wgrad: bool
    """apex's ``fused_weight_gradient_mlp_cuda`` extension imports."""

    @classmethod
    def detect(cls) -> "Hardware":
        import torch

        try:
            import fused_weight_gradient_mlp_cuda  # noqa: F401
            fused = True
        except ImportError:
            fused = False
        return cls(cuda=torch.cuda.is_available(), fused_wgrad=fused)


@dataclass(frozen=True)
class Performance:
    gradient_accumulation_fusion: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    deallocate_pipeline_outputs: bool = False


def _decide(key: str, setting, possible: bool, why_not: str) -> bool:
    if setting is True and not possible:
        raise ConfigError(f"{key} is true but {why_not}; set it to auto or false")
    return bool(possible) if setting == "auto" else bool(setting)


def resolve(parallel, hw: Optional[Hardware] = None) -> Performance:
    """The settings this run uses, from ``parallel`` (a ParallelConfig) and the machine."""
    hw = hw or Hardware.detect()
    if not hw.cuda:
        gaf_why = "it needs a CUDA GPU (this run has none)"
    else:
        gaf_why = ("apex's fused_weight_gradient_mlp_cuda extension is not installed (Megatron-Core's "
                   "ColumnParallelLinear output layer requires it, also with the Transformer Engine spec)")
    gaf = _decide("parallel.gradient_accumulation_fusion", parallel.gradient_accumulation_fusion,
                  hw.cuda and hw.fused_wgrad, gaf_why)
    ogr = _decide("parallel.overlap_grad_reduce", parallel.overlap_grad_reduce, hw.cuda,
                  "it needs a CUDA GPU (the overlap relies on CUDA stream ordering; this run has none)")
    if not parallel.use_distributed_optimizer:
        opg_why = "it needs parallel.use_distributed_optimizer: true"
    elif not ogr:
        opg_why = "it needs parallel.overlap_grad_reduce on"
    else:
        opg_why = "it needs a CUDA GPU (this run has none)"
    opg = _decide("parallel.overlap_param_gather", parallel.overlap_param_gather,
                  hw.cuda and parallel.use_distributed_optimizer and ogr, opg_why)
    dealloc = True if parallel.deallocate_pipeline_outputs is True else (
        parallel.deallocate_pipeline_outputs == "auto" and hw.cuda)
    return Performance(gaf, ogr, opg, dealloc)


def release_memory_enabled(setting, hw: Optional[Hardware] = None) -> bool:
    """``train.release_memory_between_phases`` resolved for this machine."""
    hw = hw or Hardware.detect()
    return _decide("train.release_memory_between_phases", setting, hw.cuda,
                   "the CPU allocator keeps no cache to release (it needs CUDA)")


def ddp_config_kwargs(perf: Performance) -> dict:
    """The ``DistributedDataParallelConfig`` fields these settings own."""
    return {"overlap_grad_reduce": perf.overlap_grad_reduce, "overlap_param_gather": perf.overlap_param_gather}


def transformer_config_kwargs(perf: Performance) -> dict:
    """The ``TransformerConfig`` fields these settings own."""
    return {"gradient_accumulation_fusion": perf.gradient_accumulation_fusion,
            "deallocate_pipeline_outputs": perf.deallocate_pipeline_outputs}


def gather_params(chunks) -> bool:
    """Finish the distributed optimizer's parameter all-gather now (collective over DP), when it is
    overlapped with the next forward; a no-op otherwise. Returns whether it gathered."""
    done = False
    for chunk in chunks:
        cfg = getattr(chunk, "ddp_config", None)
        if cfg is not None and cfg.use_distributed_optimizer and cfg.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
            done = True
    return done


def release_cached_memory(enabled: bool) -> None:
    """Collect garbage and return the CUDA caching allocator's unused blocks (phase boundary)."""
    if not enabled:
        return
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
