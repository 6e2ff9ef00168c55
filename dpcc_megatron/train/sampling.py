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
from typing import Optional

import torch

from ..distributed import every_rank, reduce_values
from .rollout import RolloutBatch, Rewards, advance_rounds, make_rollouts, score_rollouts


@dataclass
class IterationSamples:
    rollouts: RolloutBatch
    rewards: Rewards
    prompts_drawn: int
    """Prompts taken from the dataset this iteration (all DP ranks' shares, every round)."""
    metrics: dict = field(default_factory=dict)
    """``ds_*`` counts, ``reward_mean_sampled`` and the rule-track statistics over everything sampled
    (``reward_base_mean``, ``reward_base_std``, ``zero_var_frac_base``) when dynamic sampling is on."""
    padded: Optional[torch.Tensor] = None
    """bool [rows]: rows of padding groups (dynamic sampling's batch still short), None without any."""
    weight_version: Optional[int] = None
    """The weight version (iteration whose starting weights) that sampled every row of this batch, set by
    train/async_rollout.py when rollout.max_staleness >= 1; None: the iteration's own weights."""

    @property
    def weight_versions(self) -> Optional[torch.Tensor]:
        """int64 [rows]: the version that produced each sample (one request per batch: all equal)."""
        if self.weight_version is None:
            return None
        return torch.full((len(self.rollouts.texts),), self.weight_version, dtype=torch.long)

    def to_batch(self, advantages: torch.Tensor):
        """The training batch: padding rows get advantage 0 and an all-False mask, so they contribute
        nothing to the loss, its normaliser (token, sequence and row counts) or the reference-KL term."""
        if self.padded is None or not bool(self.padded.any()):
            return self.rollouts.to_batch(advantages)
        pad = self.padded
        adv = advantages.clone()
        adv[pad] = 0.0
        batch = self.rollouts.to_batch(adv)
        batch.mask[pad] = False
        batch.sampler_logprobs[pad] = 0.0
        return batch


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
    pending: list = []  # scored samples whose reward-state step waits for the last round
    for r in range(cfg.rollout.dynamic_sampling_max_rounds):
        prompts = ctx.dataset.next_batch(P)
        rollouts = make_rollouts(ctx, prompts, iteration, round_index=r)
        rewards = score_rollouts(ctx, rollouts, pending=pending)
        rounds.append((rollouts, rewards))
        flags.append(informative_groups(rewards.base, G))  # the rule track: independent of the weights
        full = sum(int(f.sum()) for f in flags) >= need
        if every_rank(full):
            break
    rounds = [(ro, rw) for (ro, _), rw in zip(rounds, advance_rounds(ctx, pending))]
    picked = choose_groups(flags, need)
    kept = sum(1 for r, g in picked if flags[r][g])
    rollouts = RolloutBatch.concat([rounds[r][0].select_groups([g], G) for r, g in picked])
    rewards = Rewards.concat([rounds[r][1].select_groups([g], G) for r, g in picked])
    padded = torch.tensor([not bool(flags[r][g]) for r, g in picked for _ in range(G)], dtype=torch.bool)
    sampled = torch.cat([rw.total.float() for _, rw in rounds])
    base = torch.cat([rw.base.double() for _, rw in rounds])
    base_groups = base.view(-1, G)
    metrics = {"ds_rounds": len(rounds), "ds_sampled_groups": sum(len(f) for f in flags),
               "ds_kept_groups": kept, "ds_dropped_groups": sum(len(f) for f in flags) - kept,
               "ds_padded_groups": need - kept, "reward_mean_sampled": float(sampled.float().mean())}
    sums = {"base_sum": float(base.sum()), "base_sq_sum": float((base * base).sum()), "base_n": float(base.numel()),
            "base_zero_var_groups": float((base_groups.amax(-1) == base_groups.amin(-1)).sum())}
    return IterationSamples(rollouts, rewards, P * len(rounds), _sum_over_dp(ctx, metrics, sums), padded)


def _sum_over_dp(ctx, metrics: dict, sums: dict) -> dict:
    """Group counts over all DP ranks; the reward mean averaged over them (equal sample counts); the
    rule-track mean, std and zero-variance group share of everything sampled on every DP rank."""
    keys = [k for k in metrics if k.endswith("_groups")]
    t = reduce_values([float(metrics[k]) for k in keys] + [metrics["reward_mean_sampled"]] + list(sums.values()),
                      "sum", ctx.dp_group if ctx.dp > 1 else None)
    if ctx.dp > 1:
        t[len(keys)] /= ctx.dp
    out = dict(metrics)
    out.update({k: int(round(float(v))) for k, v in zip(keys, t[:len(keys)])})
    out["reward_mean_sampled"] = float(t[len(keys)])
    s = dict(zip(sums, (float(v) for v in t[len(keys) + 1:])))
    n = max(s["base_n"], 1.0)
    mean = s["base_sum"] / n
    out["reward_base_mean"] = mean
    out["reward_base_std"] = max(s["base_sq_sum"] / n - mean * mean, 0.0) ** 0.5
    out["zero_var_frac_base"] = s["base_zero_var_groups"] / max(out["ds_sampled_groups"], 1)
    return out
