"""Supervised warm-start batches (``train.warmup_sft_steps``).

With ``data.prompts`` the batches are the training data's own prompts with their gold
responses (GSM8K/MATH worked solutions, verl's ``extra_info.answer``, plain ``response`` or
``answer``, code solutions), encoded as generation sees them: the prompt through the chat
template, the response as the template's assistant turn up to its end-of-turn token. A file
whose records carry no gold response is refused before the model is built; the warm-start
never trains on another task. Without a file it uses the synthetic task's answers.
Pairs longer than ``model.max_seq_len`` keep the prompt and a truncated response (counted in
``sft_truncated``).
"""
from __future__ import annotations

import random

from ..data.prompts import synthetic_prompts
from ..megatron.policy_step import RLBatch


def check_gold(cfg, prompts) -> None:
    """Refuse a warm-start on data without gold responses, naming the first record that lacks one."""
    if not cfg.data.prompts:
        return
    missing = [p for p in prompts if not p.gold]
    if missing:
        raise ValueError(
            f"train.warmup_sft_steps={cfg.train.warmup_sft_steps} needs gold responses, but {len(missing)} of "
            f"{len(prompts)} records of data.prompts have none (first: {missing[0].source}; data.format="
            f"{cfg.data.format!r}). Use a layout with gold answers (gsm8k, math, verl with extra_info.answer, plain "
            "with 'response' or 'answer', code with a solution) or set train.warmup_sft_steps: 0")


def _prompts_for_step(ctx, step: int) -> list:
    cfg = ctx.cfg
    n = cfg.train.mini_batch_size
    if not cfg.data.prompts:
        return synthetic_prompts(cfg.data.synthetic_task, cfg.data.synthetic_digits, n,
                                 seed=cfg.train.seed * 31 + step + 1)
    pool = ctx.dataset.prompts
    rng = random.Random(cfg.train.seed * 31 + step + 1)  # independent of the RL prompt stream's position
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def sft_batch(ctx, step: int) -> RLBatch:
    from .rollout import encode_prompts, pack_sequences

    mine = _prompts_for_step(ctx, step)[ctx.dp_rank::ctx.dp]
    pids = encode_prompts(ctx, mine)
    chat = ctx.cfg.data.chat_template
    limit = ctx.cfg.model.max_seq_len
    rids = []
    for p, ids in zip(mine, pids):
        r = ctx.tokenizer.encode_response(p.chat_input, p.gold, chat=chat)
        if len(ids) + len(r) > limit:
            r = r[: max(1, limit - len(ids))]
            ctx.counters["sft_truncated"] += 1
        rids.append(r)
    tokens, mask = pack_sequences(pids, rids, ctx.tokenizer.pad_id)
    return RLBatch(tokens=tokens, mask=mask)
