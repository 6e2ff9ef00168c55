"""Rollouts for one iteration: prompts -> sampled responses -> rewards, in the trainer's layout.

Every sample is stored as ``prompt + response`` starting at position 0 and right-padded,
so training forwards use plain positions ``0..L-1``; per-token tensors are aligned with
the targets ``tokens[:, 1:]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..megatron.policy_step import RLBatch


def pack_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int):
    """-> tokens [N, L] long, mask [N, L-1] bool (True where the target is a response token)."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    L = max(max(lengths), 2)
    tokens = torch.full((len(prompt_ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), L - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        seq = p + r
        tokens[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, len(p) - 1:len(seq) - 1] = True
    return tokens, mask


@dataclass
class RolloutBatch:
    """This data-parallel rank's samples: G consecutive samples per prompt."""

    prompts: list
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    sampler_logprobs: list[torch.Tensor]
    """Per response token, the sampler's log-prob under the raw (temperature-1) policy."""
    finished: list[bool]
    """Stopped at EOS (False: hit max_new_tokens)."""
    pad_id: int

    def to_batch(self, advantages: torch.Tensor) -> RLBatch:
        tokens, mask = pack_sequences(self.prompt_ids, self.response_ids, self.pad_id)
        return RLBatch(tokens=tokens, mask=mask, advantages=advantages.float(),
                       sampler_logprobs=self.sampler_logprob_matrix(mask))

    def sampler_logprob_matrix(self, mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mask.shape, dtype=torch.float32)
        for i, lp in enumerate(self.sampler_logprobs):
            out[i, mask[i]] = lp.float()[: int(mask[i].sum())]
        return out


def _encode_prompts(ctx, prompts) -> list[list[int]]:
    out = []
    limit = ctx.cfg.data.max_prompt_len
    for p in prompts:
        ids = ctx.tokenizer.encode(p.text)
        if len(ids) > limit:  # keep the end: it holds the question
            ids = ids[-limit:]
            ctx.counters["prompts_truncated"] += 1
        out.append(ids)
    return out


def _generate(ctx, prompt_ids: list[list[int]], *, greedy: bool, seed: int):
    from ..megatron.generate import generate, rollout_generator

    r = ctx.cfg.rollout
    return generate(ctx.chunks, prompt_ids, max_new_tokens=r.max_new_tokens, eos_id=ctx.tokenizer.eos_id,
                    pad_id=ctx.tokenizer.pad_id, temperature=0.0 if greedy else r.temperature,
                    top_p=1.0 if greedy else r.top_p, top_k=0 if greedy else r.top_k,
                    generator=rollout_generator(ctx.chunks, seed), tp_group=ctx.tp_group,
                    pp_group=ctx.pp_group, vocab_size=ctx.vocab_size, batch_size=r.batch_size)


def _unpack(out, n: int):
    """Responses, their sampler-side temperature-1 policy log-probs (what the trainer recomputes,
    so the difference is pure sampler/trainer mismatch), and whether each stopped at EOS."""
    responses, logprobs, finished = [], [], []
    for i in range(n):
        m = out.response_mask[i].bool()
        responses.append(out.tokens[i][m].tolist())
        logprobs.append(out.policy_logprobs[i][m].detach().float().cpu())
        finished.append(bool(out.stopped_by_eos[i]))
    return responses, logprobs, finished


def make_rollouts(ctx, prompts, iteration: int) -> RolloutBatch:
    """G samples for this DP rank's share of ``prompts``."""
    G = ctx.cfg.rollout.group_size
    mine = prompts[ctx.dp_rank::ctx.dp]
    expanded = [p for p in mine for _ in range(G)]
    prompt_ids = _encode_prompts(ctx, expanded)
    seed = ctx.cfg.train.seed * 1_000_003 + iteration * 1009 + ctx.dp_rank
    out = _generate(ctx, prompt_ids, greedy=False, seed=seed)
    responses, logprobs, finished = _unpack(out, len(expanded))
    texts = [ctx.tokenizer.decode(r) for r in responses]
    return RolloutBatch(expanded, prompt_ids, responses, texts, logprobs, finished, ctx.tokenizer.pad_id)


@dataclass
class Rewards:
    total: torch.Tensor
    base: torch.Tensor
    advanced: torch.Tensor
    weights_dict: dict
    metrics: dict
    per_component: bool

    @property
    def for_advantages(self) -> torch.Tensor:
        return torch.stack([self.base, self.advanced], -1) if self.per_component else self.total

    @property
    def weights(self) -> Optional[list]:
        return [self.weights_dict["base"], self.weights_dict["advanced"]] if self.per_component else None


def _samples(ctx, prompts, texts, response_ids, group_ids):
    from ..rewards import Sample

    out = []
    for p, text, ids, g in zip(prompts, texts, response_ids, group_ids):
        f = p.fields
        out.append(Sample(prompt=p.text, response=text, task=f.get("task", "text"),
                          answer=None if f.get("answer") is None else str(f.get("answer")), tests=f.get("tests"),
                          schema=f.get("schema"), pattern=f.get("pattern"), language=f.get("language"),
                          group_id=g, response_ids=ids))
    return out


def score_rollouts(ctx, rollouts: RolloutBatch) -> Rewards:
    """Scored once per model-parallel group (sandboxed code runs are not repeated TP x PP times)."""
    G = ctx.cfg.rollout.group_size
    payload = None
    if ctx.mp_rank == 0:
        samples = _samples(ctx, rollouts.prompts, rollouts.texts, rollouts.response_ids,
                           [i // G for i in range(len(rollouts.texts))])
        res = ctx.reward.score(samples)
        ctx.reward.push_buffer(samples, res)
        payload = (res.total.float(), res.base.float(), res.advanced.float(), dict(res.weights), dict(res.metrics))
    if dist.is_initialized() and dist.get_world_size(ctx.mp_group) > 1:
        box = [payload]
        dist.broadcast_object_list(box, src=dist.get_global_rank(ctx.mp_group, 0), group=ctx.mp_group)
        payload = box[0]
    total, base, adv, weights, metrics = payload
    return Rewards(total, base, adv, weights, metrics, ctx.cfg.loss.advantage_per_component)


def evaluate_greedy(ctx) -> float:
    """Mean base-track (rule) reward of greedy answers on held-out prompts, over all DP ranks."""
    prompts = ctx.eval_prompts[ctx.dp_rank::ctx.dp]
    prompt_ids = _encode_prompts(ctx, prompts)
    out = _generate(ctx, prompt_ids, greedy=True, seed=0)
    responses, _, _ = _unpack(out, len(prompts))
    texts = [ctx.tokenizer.decode(r) for r in responses]
    score = torch.zeros(2, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    if ctx.mp_rank == 0 and prompts:
        res = ctx.reward.score(_samples(ctx, prompts, texts, responses, list(range(len(prompts)))), update=False)
        score[0], score[1] = float(res.base.sum()), float(len(prompts))
    if dist.is_initialized():
        dist.all_reduce(score)
    return round(float(score[0] / score[1].clamp(min=1)), 4)
