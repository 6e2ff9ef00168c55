"""The per-iteration metric record: the monitor's field names, one flat dict of floats."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..algo import combine_metrics
from ..megatron.policy_step import EXTRA_REDUCTIONS
from ..megatron.moe import moe_record_fields, moe_reductions


def _f(x):
    """A float, or None for a missing value: the detector reads NaN as a non-finite alarm."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def sample_utilization(merged: dict) -> float | None:
    """Share of advantage-carrying tokens whose gradient was nonzero, over the iteration's steps.

    None when no token carried an advantage (every group had equal rewards): there was nothing
    to use, and a 0 would read as "every token was dropped"."""
    if merged.get("num_adv_tokens", 0.0) <= 0:
        return None
    return _f(merged.get("utilisation", float("nan")))


STALE_MISMATCH_FIELDS = ("mismatch_kl", "mismatch_max_abs")
"""Left missing (None) for a batch sampled by older weights: there they would measure staleness."""


def logprob_stats(batch, rollouts, old_lp, entropy, tis_cap=None, on_policy: bool = True) -> dict:
    """Entropy, perplexity and sampler/trainer mismatch (KL(sampler||trainer), importance-weight
    statistics) from the trainer's old-policy forward; mismatch is kept apart from policy drift.

    ``on_policy``: the batch was sampled by the weights the trainer holds (always with
    ``rollout.max_staleness: 0``). Otherwise the sampler's log-probs come from an older version, so
    their gap to the trainer's is staleness plus mismatch (``kl_behaviour`` reports it), and
    ``mismatch_kl`` / ``mismatch_max_abs`` are None; the ``is_weight_*`` statistics then describe the
    behaviour importance weight pi_prox / pi_b."""
    from ..megatron.precision import mismatch_stats

    # The trainer hands these over on the host (train/passes.py); a caller with device outputs
    # still gets one device: the masks and the sampler's log-probs follow the outputs.
    device = old_lp.device
    mask = batch.mask.to(device)
    entropy = entropy.to(device)
    n = mask.sum().clamp(min=1)
    if not bool(mask.any()):  # every row is padding (dynamic sampling kept no group): nothing to measure,
        return {"entropy": None, "perplexity": None}  # and a 0 would read as a low-entropy collapse
    out = {
        "entropy": float((entropy * mask).sum() / n),
        "perplexity": float(torch.exp(-(old_lp * mask).sum() / n)),
    }
    sampler = rollouts.sampler_logprob_matrix(batch.mask).to(device)
    try:
        out.update(mismatch_stats(old_lp, sampler, mask, tis_cap))
    except ValueError:  # non-finite log-probs: leave the fields out; the step itself is skipped
        pass
    out["mismatch_max_abs"] = float(((sampler - old_lp) * mask).abs().max()) if mask.any() else 0.0
    if not on_policy:
        out.update(dict.fromkeys(STALE_MISMATCH_FIELDS))
    return out


def build_record(ctx, iteration, rollouts, rewards, adv_metrics, batch, lp_stats, steps, controller,
                 seconds, step_kl_after: Optional[float] = None) -> dict:
    """The iteration's record. ``step_kl_after``: with one optimizer step per iteration, that step's KL
    measured after it (``monitor.step_kl_probe``); its in-step KL is the fresh ~0 one."""
    from ..monitor.metrics import entropy_fraction, group_distinct_fraction, response_metrics

    cfg = ctx.cfg
    taken = [s for s in steps if not s.skipped]
    # A step with non-finite logits has garbage metrics (a KL of up to ~1e8): leave it out.
    usable = [s for s in steps if not s.nonfinite_logits]
    reductions = {**EXTRA_REDUCTIONS, **moe_reductions(k for s in usable for k in s.metrics)}
    merged = combine_metrics([dict(s.metrics) for s in usable], reductions) if usable else {}
    est = cfg.loss.dpcc.kl_estimator
    rec = {
        "iteration": iteration,
        "consumed_samples": ctx.consumed_samples + len(rollouts.prompts) * ctx.dp,
        "reward_mean": _f(rewards.total.mean()),
        "reward_std": _f(rewards.total.std(correction=0)),
        "reward_base_mean": _f(rewards.base.mean()),
        "kl_old_new": _f(merged.get(f"kl_{est}", float("nan"))),
        "kl_estimator": est,
        "clip_frac": _f(merged.get("clip_frac_low", 0.0) + merged.get("clip_frac_high", 0.0)),
        "ratio_max": _f(merged.get("ratio_max", float("nan"))),
        "sample_utilization": sample_utilization(merged),
        "pg_loss": _f(merged["pg_loss"] / max(len(usable), 1)) if "pg_loss" in merged else None,
        "tau": _f(merged.get("tau", controller.tau)),
        "lr": _f(taken[-1].lr) if taken else 0.0,
        "lr_factor": _f(steps[-1].lr_factor) if steps else 1.0,
        "lr_factor_min": min((s.lr_factor for s in steps), default=1.0),
        "grad_norm": _f(taken[-1].grad_norm) if taken else None,
        "steps_taken": ctx.counters["steps_taken"],
        "steps_skipped": ctx.counters["steps_skipped"],
        "steps_nonfinite": len(steps) - len(usable),
        "optimizer_steps": len(steps),
        "update_frequency": len(taken) / max(len(steps), 1),
        "zero_var_frac": _f(adv_metrics.get("zero_variance_frac", 0.0)),
        "response_len": sum(len(r) for r in rollouts.response_ids) / max(len(rollouts.response_ids), 1),
        "seconds": seconds,
    }
    rec.update(moe_record_fields(merged))  # expert load, dropped tokens, router aux losses (MoE only)
    if ctx.reference is not None:  # KL(pi_theta || pi_ref) over the iteration's updates (loss.kl_estimator)
        # an iteration whose rows are all padding has no token to measure it on
        rec["kl_ref"] = _f(merged.get("ref_kl", float("nan"))) if bool(batch.mask.any()) else None
        rec["kl_ref_estimator"] = cfg.loss.kl_estimator  # the penalty's, which may differ from kl_old_new's
    # What the detector judges on: the rule track (no contrastive tie-breakers) and each step's own KL.
    G = cfg.rollout.group_size
    base_groups = rewards.base.view(-1, G)
    rec["reward_base_std"] = _f(rewards.base.std(correction=0))
    rec["zero_var_frac_base"] = _f((base_groups.amax(-1) == base_groups.amin(-1)).float().mean())
    # Distinct answers per group / G: a template collapse drives it to 1/G with the reward low.
    rec["answer_distinct_frac"] = group_distinct_fraction(rollouts.response_ids, G)
    step_kls = [s.metrics[f"kl_{est}"] for s in usable if f"kl_{est}" in s.metrics]
    if step_kl_after is not None and math.isfinite(step_kl_after):
        step_kls.append(step_kl_after)
    rec["kl_step_max"] = _f(max(step_kls)) if step_kls else None
    rec.update({k.replace("reward/", "reward_"): _f(v) for k, v in rewards.metrics.items()
                if isinstance(v, (int, float))})
    rec.update(lp_stats)
    rec.update(response_metrics(token_seqs=rollouts.response_ids, texts=rollouts.texts))
    if lp_stats.get("entropy") is not None:
        rec["entropy_frac"] = entropy_fraction(lp_stats["entropy"], ctx.vocab_size)
    tokens = int(batch.mask.sum()) * ctx.dp
    rec["tokens_per_s"] = tokens / max(seconds, 1e-9)
    if cfg.loss.name == "dpcc":  # the controller's state: only the DPCC loss and LR read it
        rec.update({k: v for k, v in controller.metrics().items() if not math.isnan(v)})
    else:  # a baseline's bound is its fixed clip range; the controller's unused tau_t would mislead
        del rec["tau"]
    return rec
