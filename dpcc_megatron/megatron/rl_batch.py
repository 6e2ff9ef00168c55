"""The training batch of one data-parallel rank: prompt + response tokens and their per-token tensors.

Layout. ``tokens`` [N, L] hold prompt + response; per-token tensors ([N, L-1]) are aligned with
the *targets* ``tokens[:, 1:]``: position t scores token t+1. Pure torch, so the batching helpers
(:mod:`.batching`) and the schedule (:mod:`.policy_step`) both build on it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass
class RLBatch:
    """One data-parallel rank's samples."""

    tokens: torch.Tensor
    """[N, L] long: prompt + response, right-padded."""
    mask: torch.Tensor
    """[N, L-1] bool: targets that are response tokens."""
    old_logprobs: Optional[torch.Tensor] = None
    """[N, L-1] fp32: log pi_old of the targets (recomputed by the trainer)."""
    advantages: Optional[torch.Tensor] = None
    """[N] fp32."""
    ref_logprobs: Optional[torch.Tensor] = None
    """[N, L-1] fp32, when a reference-KL penalty is on."""
    sampler_logprobs: Optional[torch.Tensor] = None
    """[N, L-1] fp32: the rollout sampler's log-probs of the targets (for the TIS correction)."""
    routing: Optional[torch.Tensor] = None
    """[N, L-1, MoE layers on this rank, top-k] int16: experts to replay in the forward (routing
    replay, see routing_replay.py); None routes freely."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, idx) -> "RLBatch":
        return RLBatch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx])
                          for f in fields(self)})

    def split(self, size: int) -> list["RLBatch"]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def truncate(self, length: int) -> "RLBatch":
        """The first ``length`` tokens of every row (per-token tensors: the first ``length - 1``)."""
        def cut(name, t):
            if t is None or (name == "advantages" and t.dim() == 1):
                return t
            return t[:, :length] if name == "tokens" else t[:, :length - 1]
        return RLBatch(**{f.name: cut(f.name, getattr(self, f.name)) for f in fields(self)})

    def pad_targets(self, num_targets: int, pad_id: int = 0) -> "RLBatch":
        """Right-pad to ``num_targets`` target positions (tokens to ``num_targets + 1``). The new
        positions are masked out (mask False, log-probs 0), so no loss or metric sees them, and
        the model is causal, so the real positions' outputs do not change."""
        T = self.tokens.shape[1] - 1
        if num_targets == T:
            return self
        if num_targets < T:
            raise ValueError(f"cannot pad {T} target positions down to {num_targets}")
        extra = num_targets - T

        def pad(t: Optional[torch.Tensor], value) -> Optional[torch.Tensor]:
            if t is None:
                return None
            filler = torch.full((t.shape[0], extra) + tuple(t.shape[2:]), value, dtype=t.dtype, device=t.device)
            return torch.cat([t, filler], dim=1)

        per_token = lambda t: t is not None and t.dim() >= 2 and t.shape[1] == T  # noqa: E731
        from .routing_replay import pad_routing

        return RLBatch(tokens=pad(self.tokens, pad_id), mask=pad(self.mask, False),
                       old_logprobs=pad(self.old_logprobs, 0.0), ref_logprobs=pad(self.ref_logprobs, 0.0),
                       sampler_logprobs=pad(self.sampler_logprobs, 0.0),
                       advantages=pad(self.advantages, 0.0) if per_token(self.advantages) else self.advantages,
                       routing=None if self.routing is None else pad_routing(self.routing, extra))
