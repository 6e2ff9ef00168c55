"""The batched, KV-cached decode loop, independent of how the model is run.

Sequences are *column-aligned*: prompts are right-padded into one buffer, column ``c`` of
every row is position ``c``, and one step computes the next-token logits of all live rows at
the same column. Prefill covers the columns every prompt has (``min(prompt_lens)``); after
that, a row whose prompt is longer takes its own prompt token at column ``c`` instead of the
sample. This is Megatron's static-batching scheme: positions are exact (no shifted RoPE or
learned positions), the KV cache needs no padding mask, and any attention backend (local or
Transformer Engine, causal prefill then unmasked single-token decode) runs it unchanged.
Prompts are sorted by length and cut into batches, so the catch-up columns stay few.

Rows that finish (a stop id, or ``max_new_tokens``) are dropped from the batch: once a quarter of
the rows are finished, the live rows are moved to the front of the cache (``Stepper.reorder``)
and later steps feed only those.

The model side is a :class:`Stepper`; on distributed runs only some ranks see logits (the
last pipeline stage), so the sampled column goes through a :class:`Channel` that hands every
rank the same tokens, and each rank keeps identical bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol, Sequence, Union

import torch

from .sampling import check_sampling_args, sample_tokens


class NonFiniteLogitsError(FloatingPointError):
    """The policy produced NaN/Inf logits while generating (raised on every rank alike)."""


class Stepper(Protocol):
    def forward(self, prefix: torch.Tensor, start: int) -> Optional[torch.Tensor]:
        """Next-token logits ``[b, V]`` (fp32, unpadded vocabulary) for each row of ``prefix [b, c]``.

        Row ``j`` of ``prefix`` is cache row ``j``; columns ``[0, start)`` were given in earlier calls
        (a cached stepper only needs ``prefix[:, start:]``). Returns None where no logits live.
        """

    def reorder(self, order: torch.Tensor) -> None:
        """Cache row ``j`` now holds what row ``order[j]`` held (``order`` lists the live rows first)."""

    # Optional: ``recorded_routing() -> Optional[Tensor]`` [b, width, layers, k], per batch row (the
    # order of the prompts the stepper was made for) and input column, what the stepper's forwards
    # recorded (a mixture of experts' routing; see dpcc_megatron/megatron/generate.py).


class Channel(Protocol):
    is_sampler: bool
    """True on ranks whose stepper returns logits; they sample."""

    def share(self, value: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Every rank gets the sampler's ``value`` (other ranks pass None and a buffer ``like`` it)."""


class LocalChannel:
    """One process holds the whole model."""

    is_sampler = True

    def share(self, value: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        return value


@dataclass
class Rollout:
    """Generated sequences, right-padded. Column ``t`` of every per-token tensor refers to ``tokens[:, t]``."""

    tokens: torch.Tensor
    """[N, L] int64: prompt, then response (including the EOS when one was drawn), then pad_id."""
    prompt_lens: torch.Tensor
    """[N] int64."""
    response_lens: torch.Tensor
    """[N] int64: generated tokens, EOS included."""
    response_mask: torch.Tensor
    """[N, L] fp32: 1 on generated tokens (EOS included), 0 on prompt and padding."""
    sampler_logprobs: torch.Tensor
    """[N, L] fp32: log-prob of ``tokens[:, t]`` under the processed distribution (temperature,
    top-k, top-p) it was drawn from; 0 for greedy and outside the response."""
    policy_logprobs: torch.Tensor
    """[N, L] fp32: log-prob of ``tokens[:, t]`` under the raw temperature-1 policy over the unpadded
    vocabulary, as the sampler computed it (compare with the trainer's recomputation); 0 outside the response."""
    stopped_by_eos: torch.Tensor
    """[N] bool: the response ended with a stop id (EOS or another; False: it hit max_new_tokens)."""
    routing: Optional[torch.Tensor] = None
    """[N, L, layers, k] int16 when the stepper records it (mixture of experts): the experts the input
    token at column ``t`` was routed to, as sampled; columns a sequence never fed (its last token,
    padding) hold what the stepper left there. None otherwise."""

    def responses(self) -> list[list[int]]:
        out = []
        for row, p, r in zip(self.tokens.tolist(), self.prompt_lens.tolist(), self.response_lens.tolist()):
            out.append(row[p:p + r])
        return out


StopIds = Union[int, Iterable[int], None]


def stop_id_tensor(eos_id: StopIds, vocab_size: int, device) -> torch.Tensor:
    """The stop ids as a sorted int64 tensor (empty: never stop early); each must be in the vocabulary."""
    ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ValueError(f"eos_id {i!r} is outside the vocabulary [0, {vocab_size})")
    return torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    if len(prompts) == 0:
        raise ValueError("prompts: need at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: generation needs at least one prompt token")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompts[{i}] holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab_size})")


def _decode_batch(stepper: Stepper, channel: Channel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                  stop: torch.Tensor, pad_id: int, temperature: float, top_p: float, top_k: int,
                  generator: Optional[torch.Generator], device: torch.device) -> Rollout:
    n = len(prompts)
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    width = int(plen.max()) + max_new_tokens
    buf = torch.full((n, width), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = torch.as_tensor(p, dtype=torch.long)
    made = torch.zeros(n, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    by_eos = torch.zeros(n, dtype=torch.bool, device=device)
    lp_sampler = torch.zeros(n, width, dtype=torch.float32, device=device)
    lp_policy = torch.zeros(n, width, dtype=torch.float32, device=device)

    rows = torch.arange(n, device=device)  # cache row -> sequence index
    start, col = 0, int(plen.min())
    while True:
        logits = stepper.forward(buf[rows, :col], start)
        start = col
        sample = None
        if channel.is_sampler:
            sample = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            drawn = sample.tokens.masked_fill(~torch.isfinite(logits).all(dim=-1), -1)
        else:
            drawn = None
        drawn = channel.share(drawn, torch.empty(len(rows), dtype=torch.long, device=device))
        bad = rows[drawn < 0]
        if len(bad):
            raise NonFiniteLogitsError(f"non-finite logits while generating column {col} of sequences {bad.tolist()}")

        gen = (plen[rows] <= col) & ~done[rows]  # rows whose token at `col` is a response token
        seq = rows[gen]
        tok = drawn[gen]
        buf[seq, col] = tok
        made[seq] += 1
        if sample is not None:
            lp_sampler[seq, col] = sample.logprobs[gen]
            lp_policy[seq, col] = sample.policy_logprobs[gen]
        hit_eos = torch.isin(tok, stop)
        by_eos[seq] = hit_eos
        done[seq] = hit_eos | (made[seq] >= max_new_tokens)
        if bool(done.all()):
            break
        col += 1
        live = ~done[rows]
        n_live = int(live.sum())
        if n_live <= 0.75 * len(rows):
            order = torch.cat([torch.nonzero(live).flatten(), torch.nonzero(~live).flatten()])
            stepper.reorder(order)
            rows = rows[order[:n_live]]

    lp_sampler = channel.share(lp_sampler if channel.is_sampler else None, lp_sampler)
    lp_policy = channel.share(lp_policy if channel.is_sampler else None, lp_policy)
    cols = torch.arange(width, device=device).unsqueeze(0)
    mask = ((cols >= plen.unsqueeze(1)) & (cols < (plen + made).unsqueeze(1))).float()
    recorded = getattr(stepper, "recorded_routing", None)
    return Rollout(tokens=buf, prompt_lens=plen, response_lens=made, response_mask=mask,
                   sampler_logprobs=lp_sampler * mask, policy_logprobs=lp_policy * mask, stopped_by_eos=by_eos,
                   routing=recorded() if recorded is not None else None)


def decode(new_stepper: Callable[[int, int], Stepper], channel: Channel, prompts: Sequence[Sequence[int]], *,
           max_new_tokens: int, eos_id: StopIds, pad_id: int, vocab_size: int, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int = 0, generator: Optional[torch.Generator] = None,
           batch_size: Optional[int] = None, device: torch.device | str = "cpu") -> Rollout:
    """Generate one response per prompt; see the module docstring for the scheme.

    ``new_stepper(batch, width)`` returns a fresh stepper (empty KV cache) for at most ``batch``
    rows of at most ``width`` columns. Prompts are sorted by length (stable) and generated
    ``batch_size`` at a time (None: all at once); the result is in the order of ``prompts``.
    ``eos_id``: the stop ids: one id, a collection of ids (an instruct model's end-of-turn token
    besides its EOS), or None; a row ends with the first one it draws (kept in the response).
    Deterministic for a given generator state; the generator advances.
    """
    check_sampling_args(temperature, top_p, top_k)
    check_prompts(prompts, vocab_size)
    device = torch.device(device)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id {pad_id} is outside the vocabulary [0, {vocab_size})")
    stop = stop_id_tensor(eos_id, vocab_size, device)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if temperature > 0 and generator is None:
        raise ValueError("sampling with temperature > 0 needs a torch.Generator (determinism)")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batch_size = batch_size or len(prompts)
    parts = []
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        batch = [prompts[i] for i in idx]
        width = max(len(p) for p in batch) + max_new_tokens
        part = _decode_batch(new_stepper(len(batch), width), channel, batch, max_new_tokens=max_new_tokens,
                             stop=stop, pad_id=pad_id, temperature=temperature, top_p=top_p, top_k=top_k,
                             generator=generator, device=device)
        parts.append((idx, part))
    return _merge(parts, len(prompts), pad_id, device)


def _merge(parts, n: int, pad_id: int, device) -> Rollout:
    """Place each batch's rows back at their prompt indices, trimming to the longest sequence."""
    length = max(int((p.prompt_lens + p.response_lens).max()) for _, p in parts)

    def grid(dtype, fill):
        return torch.full((n, length), fill, dtype=dtype, device=device)

    out = Rollout(tokens=grid(torch.long, pad_id), prompt_lens=torch.zeros(n, dtype=torch.long, device=device),
                  response_lens=torch.zeros(n, dtype=torch.long, device=device),
                  response_mask=grid(torch.float32, 0.0), sampler_logprobs=grid(torch.float32, 0.0),
                  policy_logprobs=grid(torch.float32, 0.0),
                  stopped_by_eos=torch.zeros(n, dtype=torch.bool, device=device))
    if parts[0][1].routing is not None:
        shape = parts[0][1].routing.shape[2:]
        out.routing = torch.zeros((n, length, *shape), dtype=parts[0][1].routing.dtype)
    for idx, part in parts:
        idx = torch.as_tensor(idx, dtype=torch.long, device=device)
        w = min(length, part.tokens.shape[1])
        if out.routing is not None:
            out.routing[idx.cpu(), :w] = part.routing[:, :w]
        for name in ("tokens", "response_mask", "sampler_logprobs", "policy_logprobs"):
            getattr(out, name)[idx, :w] = getattr(part, name)[:, :w]
        for name in ("prompt_lens", "response_lens", "stopped_by_eos"):
            getattr(out, name)[idx] = getattr(part, name)
    return out
