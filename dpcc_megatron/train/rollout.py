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
from .refit import agreed


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
    """Stopped at a stop id (False: hit max_new_tokens)."""
    pad_id: int
    routing: Optional[list] = None
    """Mixture of experts with routing replay: per sample, the sampler's routing (Generation.routing)."""

    def to_batch(self, advantages: torch.Tensor) -> RLBatch:
        from ..megatron.routing_replay import routing_matrix

        tokens, mask = pack_sequences(self.prompt_ids, self.response_ids, self.pad_id)
        return RLBatch(tokens=tokens, mask=mask, advantages=advantages.float(),
                       sampler_logprobs=self.sampler_logprob_matrix(mask),
                       routing=None if self.routing is None else routing_matrix(self.routing, mask.shape[1]))

    def select_groups(self, groups: list[int], group_size: int) -> "RolloutBatch":
        """The samples of the given groups (G consecutive samples each), in that order."""
        idx = [g * group_size + j for g in groups for j in range(group_size)]
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return RolloutBatch(pick(self.prompts), pick(self.prompt_ids), pick(self.response_ids), pick(self.texts),
                            pick(self.sampler_logprobs), pick(self.finished), self.pad_id,
                            None if self.routing is None else pick(self.routing))

    @staticmethod
    def concat(parts: list["RolloutBatch"]) -> "RolloutBatch":
        return RolloutBatch(*(sum((getattr(p, name) for p in parts), []) for name in
                              ("prompts", "prompt_ids", "response_ids", "texts", "sampler_logprobs", "finished")),
                            parts[0].pad_id, None if any(p.routing is None for p in parts)
                            else sum((p.routing for p in parts), []))

    def sampler_logprob_matrix(self, mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mask.shape, dtype=torch.float32)
        for i, lp in enumerate(self.sampler_logprobs):
            out[i, mask[i]] = lp.float()[: int(mask[i].sum())]
        return out


def encode_prompts(ctx, prompts) -> list[list[int]]:
    """Token ids of each prompt: chat template (data.chat_template) or raw, BOS as the tokenizer says.
    Prompts longer than data.max_prompt_len keep their end (it holds the question) and are counted."""
    out = []
    limit = ctx.cfg.data.max_prompt_len
    chat = ctx.cfg.data.chat_template
    for p in prompts:
        try:
            ids = ctx.tokenizer.encode_prompt(p.chat_input, chat=chat)
        except ValueError as e:
            raise ValueError(f"{p.source or 'prompt'}: {e}") from None
        if len(ids) > limit:
            ids = ids[-limit:]
            ctx.counters["prompts_truncated"] += 1
        out.append(ids)
    return out


def sampling_params(ctx, *, greedy: bool, seed: int):
    """The engine's :class:`~dpcc_megatron.rollout.engine.Sampling`: greedy, or at the rollout's temperature,
    top-p and top-k, with ``seed``."""
    from ..rollout.engine import Sampling

    r = ctx.cfg.rollout
    return Sampling(max_new_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                    top_p=r.top_p, top_k=r.top_k, seed=seed, stop_token_ids=tuple(sorted(ctx.tokenizer.stop_ids)))


def generate(ctx, prompt_ids: list[list[int]], *, greedy: bool, seed: int):
    """Through the rollout engine's interface only: one response per prompt from the current weights,
    which the engine must already serve (the trainer and the evaluator refit it first: ``ctx.weights``).
    Collective: a generation that fails on any rank raises :class:`~dpcc_megatron.rollout.engine.EngineFailure`
    on every rank."""
    ctx.weights.check_fresh()  # never generate from stale weights
    sampling = sampling_params(ctx, greedy=greedy, seed=seed)
    return agreed(ctx.weights.rank, lambda: ctx.engine.generate(prompt_ids, sampling))  # a failure stops every rank


def unpack(out, n: int):
    """Responses, their sampler-side temperature-1 policy log-probs (what the trainer recomputes,
    so the difference is pure sampler/trainer mismatch), and whether each stopped at a stop id."""
    return out.responses[:n], out.logprobs[:n], out.finished[:n]


@dataclass
class RolloutRequest:
    """What one call of the engine generates for this DP rank: G copies of its share of the prompts."""

    prompts: list
    prompt_ids: list[list[int]]
    seed: int


def rollout_request(ctx, prompts, iteration: int, round_index: int = 0) -> RolloutRequest:
    """This DP rank's G samples of ``prompts`` (``round_index``: dynamic sampling's round), as a request."""
    G = ctx.cfg.rollout.group_size
    mine = prompts[ctx.dp_rank::ctx.dp]
    expanded = [p for p in mine for _ in range(G)]
    prompt_ids = [ids for ids in encode_prompts(ctx, mine) for _ in range(G)]
    seed = ctx.cfg.train.seed * 1_000_003 + iteration * 1009 + ctx.dp_rank + round_index * 104_729
    return RolloutRequest(expanded, prompt_ids, seed)


def finish_rollouts(ctx, request: RolloutRequest, generation) -> "RolloutBatch":
    """The engine's :class:`~dpcc_megatron.rollout.engine.Generation` of ``request`` as a batch."""
    responses, logprobs, finished = unpack(generation, len(request.prompt_ids))
    texts = [ctx.tokenizer.decode(r) for r in responses]
    routing = None if generation.routing is None else generation.routing[:len(request.prompt_ids)]
    return RolloutBatch(request.prompts, request.prompt_ids, responses, texts, logprobs, finished,
                        ctx.tokenizer.pad_id, routing)


def make_rollouts(ctx, prompts, iteration: int, round_index: int = 0) -> RolloutBatch:
    """G samples for this DP rank's share of ``prompts`` (``round_index``: dynamic sampling's round)."""
    req = rollout_request(ctx, prompts, iteration, round_index)
    return finish_rollouts(ctx, req, generate(ctx, req.prompt_ids, greedy=False, seed=req.seed))


@dataclass
class Rewards:
    total: torch.Tensor
    base: torch.Tensor
    """Raw rule track, [n] in [0, 1]."""
    advanced: torch.Tensor
    """Raw contrastive track, [n] in [0, 1]."""
    weights_dict: dict
    metrics: dict
    per_component: bool
    components: Optional[torch.Tensor] = None
    """[n, 2] base and advanced after ``reward.normalize``: per-component advantages start here."""

    @property
    def for_advantages(self) -> torch.Tensor:
        return self.components if self.per_component else self.total

    def select_groups(self, groups: list[int], group_size: int) -> "Rewards":
        idx = torch.tensor([g * group_size + j for g in groups for j in range(group_size)], dtype=torch.long)
        return Rewards(self.total[idx], self.base[idx], self.advanced[idx], self.weights_dict, self.metrics,
                       self.per_component, None if self.components is None else self.components[idx])

    @staticmethod
    def concat(parts: list["Rewards"]) -> "Rewards":
        """Rows of every part in order; weights and reward-layer metrics of the last scoring call."""
        last = parts[-1]
        comps = None if last.components is None else torch.cat([p.components for p in parts])
        return Rewards(torch.cat([p.total for p in parts]), torch.cat([p.base for p in parts]),
                       torch.cat([p.advanced for p in parts]), last.weights_dict, last.metrics, last.per_component,
                       comps)

    @property
    def weights(self) -> Optional[list]:
        return [self.weights_dict["base"], self.weights_dict["advanced"]] if self.per_component else None


def reward_samples(prompts, texts, response_ids, group_ids) -> list:
    """The reward layer's :class:`~dpcc_megatron.rewards.Sample` of each response (its prompt's task fields)."""
    from ..rewards import Sample

    out = []
    for p, text, ids, g in zip(prompts, texts, response_ids, group_ids):
        f = p.fields
        if not f.get("task"):
            raise ValueError(f"{p.source or 'prompt'}: no task type (set data.default_task or a 'task' field)")
        out.append(Sample(prompt=p.text, response=text, task=f["task"],
                          answer=None if f.get("answer") is None else str(f.get("answer")), tests=f.get("tests"),
                          schema=f.get("schema"), pattern=f.get("pattern"), language=f.get("language"),
                          group_id=g, response_ids=ids))
    return out


def score_rollouts(ctx, rollouts: RolloutBatch, *, pending: Optional[list] = None) -> Rewards:
    """Scored once per model-parallel group (sandboxed code runs are not repeated TP x PP times).

    ``pending``: a list that collects this round's scored samples instead of advancing the reward
    state (dynamic sampling's rounds); :func:`advance_rounds` then advances it once for all of them."""
    G = ctx.cfg.rollout.group_size
    payload = None
    if ctx.mp_rank == 0:
        samples = reward_samples(rollouts.prompts, rollouts.texts, rollouts.response_ids,
                                 [i // G for i in range(len(rollouts.texts))])
        res = ctx.reward.score(samples, update=pending is None)
        if pending is None:
            ctx.reward.push_buffer(samples, res)
        else:
            pending.append((samples, res))
        payload = _payload(ctx, res)
    return _shared_rewards(ctx, payload)


def advance_rounds(ctx, pending: list) -> list[Rewards]:
    """Advance the reward state once over every round in ``pending`` (from :func:`score_rollouts`) and
    return each round's rewards re-combined under the new weights; the rounds' samples then join the
    older-policy buffer."""
    payloads = None
    if ctx.mp_rank == 0:
        samples = [s for batch, _ in pending for s in batch]
        results = ctx.reward.advance(samples, [res for _, res in pending])
        for (batch, _), res in zip(pending, results):
            ctx.reward.push_buffer(batch, res)
        payloads = [_payload(ctx, res) for res in results]
    if dist.is_initialized() and dist.get_world_size(ctx.mp_group) > 1:
        box = [payloads]
        dist.broadcast_object_list(box, src=dist.get_global_rank(ctx.mp_group, 0), group=ctx.mp_group)
        payloads = box[0]
    return [_shared_rewards(ctx, p, broadcast=False) for p in payloads]


def _payload(ctx, res) -> tuple:
    norm = ctx.reward.normalized_components(res)
    components = torch.stack([norm["base"], norm["advanced"]], -1).float()
    return (res.total.float(), res.base.float(), res.advanced.float(), dict(res.weights), dict(res.metrics),
            components)


def _shared_rewards(ctx, payload, broadcast: bool = True) -> Rewards:
    if broadcast and dist.is_initialized() and dist.get_world_size(ctx.mp_group) > 1:
        box = [payload]
        dist.broadcast_object_list(box, src=dist.get_global_rank(ctx.mp_group, 0), group=ctx.mp_group)
        payload = box[0]
    total, base, adv, weights, metrics, components = payload
    return Rewards(total, base, adv, weights, metrics, ctx.cfg.loss.advantage_per_component, components)

