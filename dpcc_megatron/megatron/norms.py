"""A sequence-parallel-capable torch norm for Megatron's local spec (CPU, and GPUs without TE/apex).

Megatron-Core's ``WrappedTorchNorm`` refuses ``sequence_parallel`` ("sequence parallel not
supported by torch LayerNorm"). With SP the norms run on a sequence shard of the
activations, so each TP rank's norm-weight gradient covers only its shard: the weights must
carry ``sequence_parallel = True`` so that Megatron's ``finalize_model_grads`` all-reduces
their gradients over TP, as it does for the TE and apex norms. That attribute is the whole
difference; the forward is ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``.

:func:`sequence_parallel_local_spec` swaps this norm into a local layer spec (and into the
block's final norm), so the model builder can use the local spec with SP on.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch


class SequenceParallelTorchNorm:
    """Same constructor as Megatron's ``WrappedTorchNorm``; returns a torch norm whose
    parameters are marked ``sequence_parallel`` when ``config.sequence_parallel`` is on."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("layernorm_zero_centered_gamma is not supported by the torch norm")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"model.normalization={config.normalization!r}: only LayerNorm and RMSNorm are "
                             "supported with sequence parallelism on the local spec")
        if config.sequence_parallel:
            for p in norm.parameters():
                setattr(p, "sequence_parallel", True)
        return norm


def _swap(obj: Any, old: Any, new: Any) -> Any:
    """Replace every occurrence of the class ``old`` inside a (nested) ModuleSpec by ``new``."""
    if obj is old:
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            swapped = _swap(value, old, new)
            if swapped is not value:
                changes[f.name] = swapped
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, (list, tuple)):
        items = [_swap(v, old, new) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    if isinstance(obj, functools.partial):  # megatron-core >= 0.17 builds some submodules as partials
        func = _swap(obj.func, old, new)
        args = [_swap(v, old, new) for v in obj.args]
        kw = {k: _swap(v, old, new) for k, v in obj.keywords.items()}
        unchanged = func is obj.func and all(a is b for a, b in zip(args, obj.args)) and all(
            kw[k] is obj.keywords[k] for k in kw)
        return obj if unchanged else functools.partial(func, *args, **kw)
    return obj


def spec_nodes(obj):
    """Every object a layer spec reaches: itself, its dataclass fields, list/tuple items and
    ``functools.partial`` functions and arguments (megatron-core 0.17+ wraps submodules in partials)."""
    yield obj
    if isinstance(obj, functools.partial):
        children = (obj.func, *obj.args, *obj.keywords.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        return
    for child in children:
        yield from spec_nodes(child)


def uses_torch_norm(spec) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return any(node is WrappedTorchNorm for node in spec_nodes(spec))


def sequence_parallel_local_spec(layer_spec, config, vp_stage: Optional[int] = None):
    """The local layer spec with ``WrappedTorchNorm`` replaced by :class:`SequenceParallelTorchNorm`,
    as ``TransformerBlockSubmodules`` so the block's final norm is replaced too."""
    import inspect

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = _swap(layer_spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    if "vp_stage" in inspect.signature(get_num_layers_to_build).parameters:
        n = get_num_layers_to_build(config, vp_stage=vp_stage)
    else:  # pragma: no cover - older megatron-core reads the global virtual rank
        n = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=SequenceParallelTorchNorm)


__all__ = ["SequenceParallelTorchNorm", "sequence_parallel_local_spec", "uses_torch_norm"]
