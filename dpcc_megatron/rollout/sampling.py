"""Next-token sampling: temperature, top-k, top-p, and the two log-probs the trainer records.

Pure torch, no Megatron. ``logits`` are full rows ``[b, V]`` over the *unpadded* vocabulary
(the Megatron glue gathers the tensor-parallel shards and drops the padding columns first).

Order of processing (as in HF ``generate``): divide by the temperature, keep the top-k,
then keep the smallest top-probability set whose mass reaches top-p, renormalise.
``temperature == 0`` is greedy (argmax of the raw logits).

Sampling uses the exponential race ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` drawn from
the caller's generator: it picks ``i`` with probability ``p_i``, never picks a filtered token
(``p_i = 0``), and draws on the generator's own device, so a CPU generator serves CUDA logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Sample:
    tokens: torch.Tensor
    """[b] int64: the drawn token ids."""
    logprobs: torch.Tensor
    """[b] fp32: log-prob of the token under the processed distribution it was drawn from
    (0 for greedy, whose distribution is a point mass)."""
    policy_logprobs: torch.Tensor
    """[b] fp32: log-prob of the token under the raw temperature-1 policy."""


def check_sampling_args(temperature: float, top_p: float, top_k: int) -> None:
    """Reject settings that have no meaning, naming the argument."""
    if not temperature >= 0:  # also catches NaN
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k}")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set all but the k largest logits of each row to -inf (ties with the k-th are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (always >= 1 token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p  # the top token has mass_before == 0 < p, so it always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """fp32 logits of the distribution actually sampled from (temperature > 0); filtered entries are -inf."""
    if temperature <= 0:
        raise ValueError("process_logits needs temperature > 0; temperature 0 is greedy (no distribution)")
    out = logits.float() / temperature
    return top_p_filter(top_k_filter(out, int(top_k)), top_p)


def _token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample_tokens(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None) -> Sample:
    """Draw one token per row of ``logits`` [b, V] and report both log-probs.

    ``generator`` is required unless ``temperature == 0``; the draw consumes ``b * V`` numbers
    from it whatever the filters keep, so the stream stays aligned across calls.
    """
    check_sampling_args(temperature, top_p, top_k)
    logits = logits.float()
    if temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        return Sample(tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device),
                      _token_logprob(logits, tokens))
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs a torch.Generator (determinism)")
    processed = process_logits(logits, temperature, top_k, top_p)
    probs = torch.softmax(processed, dim=-1)
    noise = torch.empty(probs.shape, dtype=torch.float32, device=generator.device).exponential_(generator=generator)
    # E can be exactly 0 in floating point; clamping keeps 0/E = 0 for filtered tokens (never inf/NaN).
    noise = noise.to(probs.device).clamp_min_(torch.finfo(torch.float32).tiny)
    tokens = torch.argmax(probs / noise, dim=-1)
    return Sample(tokens, _token_logprob(processed, tokens), _token_logprob(logits, tokens))
