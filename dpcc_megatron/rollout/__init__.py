"""Rollout generation math, independent of Megatron: sampling filters and the batched decode loop.

The Megatron-Core side (KV cache, tensor/pipeline parallel forward) is
:func:`dpcc_megatron.megatron.generate.generate`. The trainer reaches generation only through the
engine interface in :mod:`dpcc_megatron.rollout.engine` (engines: ``megatron``, ``vllm``).
"""
from .loop import Channel, LocalChannel, NonFiniteLogitsError, Rollout, Stepper, decode
from .sampling import Sample, check_sampling_args, process_logits, sample_tokens, top_k_filter, top_p_filter

__all__ = ["Channel", "LocalChannel", "NonFiniteLogitsError", "Rollout", "Sample", "Stepper", "check_sampling_args",
           "decode", "process_logits", "sample_tokens", "top_k_filter", "top_p_filter"]
