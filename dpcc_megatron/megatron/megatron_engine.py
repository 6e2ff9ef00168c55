"""The ``megatron`` rollout engine: the policy's own Megatron-Core chunks decode its rollouts.

It generates at the training TP/PP layout with :func:`dpcc_megatron.megatron.generate.generate`
(KV cache, vocabulary shards, pipeline stages), so it always serves the current training
weights: ``update_weights`` has nothing to copy. See :mod:`dpcc_megatron.rollout.engine`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..rollout.engine import Generation, RefitByVersion, Sampling


class MegatronEngine(RefitByVersion):
    name = "megatron"
    last_refit_s = 0.0  # nothing to copy: it decodes with the training weights

    def __init__(self, chunks, *, vocab_size: int, pad_id: int, tp_group=None, pp_group=None,
                 batch_size: Optional[int] = None, record_routing: bool = False):
        self.chunks = chunks
        self.record_routing = record_routing
        """Mixture of experts (``rollout.routing_replay``): each Generation carries the sampler's routing."""
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.batch_size = batch_size

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: Sampling) -> Generation:
        from .generate import generate, rollout_generator

        stops = frozenset(sampling.stop_token_ids)  # the decode loop stops at any of them
        greedy = sampling.greedy
        out = generate(self.chunks, prompt_ids, max_new_tokens=sampling.max_new_tokens,
                       eos_id=stops or None, pad_id=self.pad_id,
                       temperature=0.0 if greedy else sampling.temperature,
                       top_p=1.0 if greedy else sampling.top_p, top_k=0 if greedy else sampling.top_k,
                       generator=rollout_generator(self.chunks, sampling.seed), tp_group=self.tp_group,
                       pp_group=self.pp_group, vocab_size=self.vocab_size, batch_size=self.batch_size,
                       record_routing=self.record_routing)
        responses, logprobs, finished = [], [], []
        routing = [] if out.routing is not None else None
        for i in range(len(prompt_ids)):
            m = out.response_mask[i].bool()
            responses.append(out.tokens[i][m].tolist())
            logprobs.append(out.policy_logprobs[i][m].detach().float().cpu())
            finished.append(bool(out.stopped_by_eos[i]))
            if routing is not None:  # input positions 0 .. prompt + response - 2
                routing.append(out.routing[i, :int(out.prompt_lens[i] + out.response_lens[i]) - 1].clone())
        return Generation(responses, logprobs, finished, routing)

    def update_weights(self, chunks) -> None:
        if chunks is not self.chunks:
            self.chunks = chunks

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass
