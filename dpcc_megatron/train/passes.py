"""The iteration's forward-only passes: old-policy and reference log-probs, and their statistics."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..megatron.policy_step import RLBatch, compute_logprobs
from .devices import to_host


def old_logprobs(ctx, batch: RLBatch):
    """Old-policy log-probs and entropies, moved to the host once: every other per-sample tensor
    of the iteration (masks, advantages, rewards, sampler log-probs) lives there, and the loss
    functions move each micro-batch's slice to the device of the schedule's outputs."""
    cfg = ctx.cfg
    lp, ent = compute_logprobs(ctx.chunks, batch, micro_batch_size=cfg.train.micro_batch_size,
                               vocab_size=ctx.vocab_size, dp_size=ctx.dp,
                               max_tokens=cfg.train.max_tokens_per_micro_batch,
                               record_routing=cfg.rollout.routing_replay)  # MoE: sets batch.routing
    return to_host(lp), to_host(ent)


def ref_logprobs(ctx, batch: RLBatch):
    """log pi_ref of the batch on the host (last pipeline stage; zeros elsewhere), or None without a
    reference."""
    if ctx.reference is None:
        return None
    cfg = ctx.cfg
    lp = ctx.reference.logprobs(batch, micro_batch_size=cfg.train.micro_batch_size, vocab_size=ctx.vocab_size,
                                dp_size=ctx.dp, max_tokens=cfg.train.max_tokens_per_micro_batch)
    return to_host(lp) if lp is not None else torch.zeros(batch.mask.shape)


def shared_logprob_stats(ctx, batch, rollouts, old_lp, entropy, on_policy: bool = True) -> dict:
    """Entropy, perplexity and sampler/trainer mismatch (:func:`.metrics.logprob_stats`; ``on_policy``:
    the batch was sampled by the current weights), computed on the last pipeline stage and shared with
    every stage (rank 0 logs them)."""
    from megatron.core import parallel_state as ps

    from .metrics import logprob_stats

    stats = (logprob_stats(batch, rollouts, old_lp, entropy, ctx.cfg.precision.tis_cap, on_policy)
             if old_lp is not None else None)
    if dist.is_initialized() and dist.get_world_size(ctx.pp_group) > 1:
        box = [stats]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=ctx.pp_group)
        stats = box[0]
    return stats or {}
