"""One iteration's rollouts, with DAPO's dynamic sampling when ``rollout.dynamic_sampling`` is on.

A group whose rule-track (base) rewards are all equal teaches nothing: its advantages are 0
whatever the contrastive track says (the judge's tie-breakers would otherwise hide it). With
dynamic sampling such groups are dropped and more prompts are sampled, round after round,
until every data-parallel rank holds its share of informative groups or
``rollout.dynamic_sampling_max_rounds`` rounds have run. A rank still short after the last
round fills its batch with dropped groups (their advantages are 0, so they add nothing to the
gradient) so the batch layout stays what DP and the mini-batches need; they are counted as
``ds_padded_groups``. All ranks run the same number of rounds (agreed by an all-reduce), so
the prompt stream, and with it resume, stays identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .rollout import RolloutBatch, Rewards, make_rollouts, score_rollouts


@dataclass
class IterationSamples:
    rollouts: RolloutBatch
    rewards: Rewards
    prompts_drawn: int
    """Prompts taken from the dataset this iteration (all DP ranks' shares, every round)."""
    metrics: dict = field(default_factory=dict)
    """``ds_*`` counts and ``reward_mean_sampled`` (over everything sampled) when dynamic sampling is on."""


def informative_groups(base: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [n / G]: groups whose rule-track rewards are not all equal."""
    g = base.view(-1, group_size)
    return g.amax(-1) != g.amin(-1)


def choose_groups(informative: list[torch.Tensor], need: int) -> list[tuple[int, int]]:
    """(round, group) pairs making up a batch of ``need`` groups: informative groups in the order
    they were sampled, then, when there are too few, the first uninformative ones as padding."""
    good = [(r, g) for r, flags in enumerate(informative) for g in range(len(flags)) if flags[g]]
    pad = [(r, g) for r, flags in enumerate(informative) for g in range(len(flags)) if not flags[g]]
    return (good + pad)[:need]


def sample_iteration(ctx, iteration: int) -> IterationSamples:
    cfg = ctx.cfg
    P, G = cfg.rollout.prompts_per_iteration, cfg.rollout.group_size
    if not cfg.rollout.dynamic_sampling:
        prompts = ctx.dataset.next_batch(P)
        rollouts = make_rollouts(ctx, prompts, iteration)
        return IterationSamples(rollouts, score_rollouts(ctx, rollouts), len(prompts))

    need = P // ctx.dp  # groups per DP rank
    rounds: list[tuple[RolloutBatch, Rewards]] = []
    flags: list[torch.Tensor] = []
    for r in range(cfg.rollout.dynamic_sampling_max_rounds):
        prompts = ctx.dataset.next_batch(P)
        rollouts = make_rollouts(ctx, prompts, iteration, round_index=r)
        rewards = score_rollouts(ctx, rollouts)
        rounds.append((rollouts, rewards))
        flags.append(informative_groups(rewards.base, G))
        full = sum(int(f.sum()) for f in flags) >= need
        if _all_ranks(full):
            break
    picked = choose_groups(flags, need)
    kept = sum(1 for r, g in picked if flags[r][g])
    rollouts = RolloutBatch.concat([rounds[r][0].select_groups([g], G) for r, g in picked])
    rewards = Rewards.concat([rounds[r][1].select_groups([g], G) for r, g in picked])
    sampled = torch.cat([rw.total.float() for _, rw in rounds])
    metrics = {"ds_rounds": len(rounds), "ds_sampled_groups": sum(len(f) for f in flags),
               "ds_kept_groups": kept, "ds_dropped_groups": sum(len(f) for f in flags) - kept,
               "ds_padded_groups": need - kept, "reward_mean_sampled": float(sampled.float().mean())}
    return IterationSamples(rollouts, rewards, P * len(rounds), _sum_over_dp(ctx, metrics))


def _all_ranks(flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    if torch.cuda.is_available():
        t = t.cuda()
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0)


def _sum_over_dp(ctx, metrics: dict) -> dict:
    """Group counts over all DP ranks; the reward mean averaged over them (equal sample counts)."""
    keys = [k for k in metrics if k.endswith("_groups")]
    t = torch.tensor([float(metrics[k]) for k in keys] + [metrics["reward_mean_sampled"]], dtype=torch.float64)
    if torch.cuda.is_available():
        t = t.cuda()
    if dist.is_initialized() and ctx.dp > 1:
        dist.all_reduce(t, group=ctx.dp_group)
        t[-1] /= ctx.dp
    out = dict(metrics)
    out.update({k: int(round(float(v))) for k, v in zip(keys, t[:-1])})
    out["reward_mean_sampled"] = float(t[-1])
    return out
