"""Advanced track: group-relative Bradley-Terry win rates against group members and older samples.

Each sample is compared with every other member of its group (same
``group_key``) and with the older-policy samples kept for its prompt. With
judge utilities ``u``, ``P(i beats j) = sigmoid((u_i - u_j) / T)`` and the score
is the weighted mean win probability:

    score_i = (sum_{j in group, j != i} P(i>j) + w_buf * sum_{k in buffer} P(i>k))
              / (|group| - 1 + w_buf * |buffer|)

It lies in [0, 1], depends on the group as a set (order-invariant), a tie
contributes exactly 0.5, and a sample with nobody to compare against scores 0.5.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from typing import Hashable, Optional, Sequence

import torch

from .sample import Sample


class OlderPolicyBuffer:
    """Small FIFO of earlier samples with their base scores, keyed by prompt text.

    Keyed by prompt (not ``group_id``) because trainers often reuse per-batch
    group ids; ``per_prompt`` newest samples are kept per prompt, ``capacity`` in all.
    """

    def __init__(self, capacity: int, per_prompt: int):
        self.capacity, self.per_prompt = capacity, per_prompt
        self._items: "OrderedDict[str, deque[tuple[Sample, float]]]" = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def get(self, prompt: str) -> list[tuple[Sample, float]]:
        return list(self._items.get(prompt, ()))

    def push(self, samples: Sequence[Sample], base: Sequence[float]) -> None:
        if self.capacity == 0:
            return
        for sample, b in zip(samples, base):
            q = self._items.pop(sample.prompt, None) or deque()
            if len(q) == self.per_prompt:
                q.popleft()
                self._size -= 1
            q.append((dataclasses.replace(sample, group_id=None), float(b)))  # batch group ids mean nothing later
            self._items[sample.prompt] = q  # most recently pushed prompt goes last
            self._size += 1
        while self._size > self.capacity:  # evict the oldest entries of the stalest prompts
            prompt, q = next(iter(self._items.items()))
            q.popleft()
            self._size -= 1
            if not q:
                del self._items[prompt]

    def state_dict(self) -> dict:
        return {"entries": [[p, [[s.to_dict(), b] for s, b in q]] for p, q in self._items.items()]}

    def load_state_dict(self, state: dict) -> None:
        self._items.clear()
        self._size = 0
        for prompt, entries in state["entries"]:
            self._items[prompt] = deque((Sample.from_dict(s, "reward buffer state"), float(b)) for s, b in entries)
            self._size += len(entries)


def group_index(samples: Sequence[Sample]) -> tuple[torch.Tensor, list[Hashable]]:
    """Contiguous group ids (in order of first appearance) and the group keys they stand for."""
    ids: dict[Hashable, int] = {}
    index = [ids.setdefault(s.group_key, len(ids)) for s in samples]
    return torch.tensor(index, dtype=torch.long), list(ids)


def win_rates(u_members: torch.Tensor, u_older: Optional[torch.Tensor] = None, older_weight: float = 0.5,
              temperature: float = 1.0) -> torch.Tensor:
    """Bradley-Terry win rate of each member against the other members and the older samples."""
    n = u_members.numel()
    p = torch.sigmoid((u_members[:, None] - u_members[None, :]) / temperature)
    wins = (p.sum(1) - 0.5)  # drop the diagonal, where sigmoid(0) = 0.5
    count = torch.full_like(wins, float(n - 1))
    if u_older is not None and u_older.numel() > 0 and older_weight > 0:
        q = torch.sigmoid((u_members[:, None] - u_older[None, :]) / temperature)
        wins = wins + older_weight * q.sum(1)
        count = count + older_weight * u_older.numel()
    return torch.where(count > 0, wins / count.clamp_min(1e-12), torch.full_like(wins, 0.5)).clamp(0.0, 1.0)


def advanced_scores(samples: Sequence[Sample], base: Sequence[float], judge, buffer: Optional[OlderPolicyBuffer],
                    older_weight: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Advanced-track score of every sample (float64 tensor in [0, 1]); one judge call for the batch."""
    gidx, keys = group_index(samples)
    older: list[list[tuple[Sample, float]]] = []
    for g in range(len(keys)):
        prompts = dict.fromkeys(s.prompt for s, gi in zip(samples, gidx.tolist()) if gi == g)
        older.append([e for p in prompts for e in (buffer.get(p) if buffer is not None else [])])
    flat_samples = list(samples) + [s for entries in older for s, _ in entries]
    flat_base = list(base) + [b for entries in older for _, b in entries]
    u = judge.utilities(flat_samples, flat_base).to(torch.float64)
    if u.shape != (len(flat_samples),) or not torch.isfinite(u).all():
        raise ValueError(f"judge returned utilities of shape {tuple(u.shape)} (finite: {bool(torch.isfinite(u).all())}) "
                         f"for {len(flat_samples)} samples")
    out = torch.empty(len(samples), dtype=torch.float64)
    offset = len(samples)
    for g, entries in enumerate(older):
        members = (gidx == g).nonzero().flatten()
        u_old = u[offset:offset + len(entries)]
        offset += len(entries)
        out[members] = win_rates(u[members], u_old, older_weight, temperature)
    return out
