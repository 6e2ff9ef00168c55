"""One optimizer step of the policy: forward/backward through the schedule, the DPCC
controller, the drift-aware LR and the non-finite skip.

Drift measurement (issue: react before the next step, without an extra forward).
The KL(pi_old || pi_theta) of mini-batch j is measured by mini-batch j's own forward,
which runs on the weights left by step j-1. So it *is* the drift after step j-1, and
it feeds step j's LR factor before step j's ``optimizer.step()``. tau_t of step j's
loss was fixed from the observations up to j-1, because the loss is computed in that
same forward.

Counting. The LR scheduler and the controller's step counter advance together, only on
steps the optimizer applied (as Megatron-LM's train_step does): a non-finite skip and an
fp16 overflow skip advance neither. A step whose logits are non-finite gives no KL
measurement: its metrics are unusable, so the controller counts it as a non-finite
observation instead of folding a garbage KL into its average.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..algo import DPCCController
from ..config import JobConfig
from ..megatron.moe import moe_metrics, router_stats
from ..megatron.optimizer import grad_scaler, grads_are_finite, scaled_lr, zero_grads
from ..megatron.policy_step import (RLBatch, global_normalizer, micro_batches, policy_loss_fn,
                                    reduce_step_metrics, run_schedule, sft_loss_fn)


@dataclass
class StepResult:
    metrics: dict
    skipped: bool
    grad_norm: float
    lr: float
    lr_factor: float
    overflow: bool = False
    """An fp16 loss-scale overflow that the scaler handled (not a sign of divergence by itself)."""
    nonfinite_logits: bool = False
    """The forward produced non-finite logits: the step was skipped and its metrics are unusable."""


def _at_min_scale(scaler) -> bool:
    return bool(scaler.scale.item() <= scaler.min_scale.item())


def _optimizer_step(chunks, optimizer, scheduler, factor: float) -> tuple[bool, float, float, bool]:
    """Skip on non-finite gradients (all ranks agree); otherwise step at scheduled LR x factor.

    Returns (skipped, grad_norm, lr, overflow)."""
    scaler = grad_scaler(optimizer)
    # fp16: Megatron's optimizer finds the overflow itself, skips and lowers the loss scale.
    if scaler is None and not grads_are_finite(chunks):
        zero_grads(chunks, optimizer)
        return True, float("nan"), 0.0, False
    with scaled_lr(optimizer, factor) as scheduled:
        ok, grad_norm, _ = optimizer.step()
    lr = scheduled[0] * factor if scheduled else 0.0
    if scheduler is not None and ok:  # a skipped (overflow) step does not move the schedule
        scheduler.step(1)
    # Megatron's fp16 optimizer reports an overflow step as not successful: skipped, and an
    # ordinary overflow unless the scale is already at its floor (then it is real divergence).
    overflow = (not ok) and scaler is not None and not _at_min_scale(scaler)
    return (not ok), float(grad_norm) if grad_norm is not None else float("nan"), lr, overflow


def _policy_pass(chunks, controller: DPCCController, batch: RLBatch, cfg: JobConfig, *, forward_only: bool,
                 dp_size: int, dp_group, pp_group, vocab_size: int) -> tuple[dict, float, bool]:
    """The policy loss over ``batch``'s micro-batches through the schedule, shared by the update
    and the drift probe. Returns (reduced metrics, KL(pi_old || pi_theta), non-finite logits)."""
    normalizer = rl_normalizer(batch, dp_group, cfg.rollout.max_new_tokens)
    loss_fn = policy_loss_fn(controller.loss_config(cfg.loss), normalizer, behaviour_cap(cfg))
    parts, _ = micro_batches(batch, cfg.train.micro_batch_size, cfg.train.max_tokens_per_micro_batch)
    with router_stats(chunks) as moe:  # per-layer expert load, dropped tokens, aux losses (MoE only)
        outputs = run_schedule(chunks, parts, loss_fn, forward_only=forward_only, vocab_size=vocab_size,
                               dp_size=dp_size)
    metrics = reduce_step_metrics(outputs, dp_group, pp_group)
    metrics.update(moe_metrics(moe, dp_group=dp_group, pp_group=pp_group, num_micro_batches=len(parts)))
    nonfinite = metrics.get("nonfinite_logits", 0.0) > 0
    # Non-finite logits make every metric of this pass garbage (masked tokens get log-prob 0):
    # the controller counts a non-finite observation (NaN) and keeps its state.
    kl = float("nan") if nonfinite else metrics[f"kl_{cfg.loss.dpcc.kl_estimator}"]
    return metrics, kl, nonfinite


def behaviour_cap(cfg: JobConfig):
    """C of the decoupled objective's behaviour weight for this run, or None (algo/decoupled.py)."""
    from ..algo.decoupled import resolve_behaviour_cap

    return resolve_behaviour_cap(cfg.loss.behaviour_is_cap, cfg.precision.tis_cap, cfg.rollout.max_staleness)


def rl_normalizer(batch: RLBatch, dp_group, max_new_tokens: int):
    """The mini-batch's global loss normaliser. Dr. GRPO divides by the generation budget
    (B * max_new_tokens), not the padded length, and B counts the rows holding a response token:
    every sampled response has at least one, so an all-masked row is dynamic sampling's padding
    (train/sampling.py), which must not enlarge the denominator."""
    import dataclasses

    normalizer = global_normalizer(batch, dp_group, max_len=max_new_tokens)
    return dataclasses.replace(normalizer, num_rows=normalizer.num_seqs)


def policy_update(chunks, optimizer, scheduler, controller: DPCCController, batch: RLBatch, cfg: JobConfig,
                  *, dp_size: int, dp_group, pp_group, vocab_size: int, monitor_lr_scale: float = 1.0,
                  fresh: bool = False) -> StepResult:
    """One optimizer step; ``fresh``: the iteration's first mini-batch (pi_old == current weights)."""
    zero_grads(chunks, optimizer)
    metrics, kl, nonfinite = _policy_pass(chunks, controller, batch, cfg, forward_only=False, dp_size=dp_size,
                                          dp_group=dp_group, pp_group=pp_group, vocab_size=vocab_size)
    controller.observe(kl, fresh=fresh, advance=False)
    # Drift-aware LR is part of DPCC; baselines train at the plain schedule (plus monitor advice).
    factor = (controller.lr_factor if cfg.loss.name == "dpcc" else 1.0) * monitor_lr_scale
    if nonfinite:
        zero_grads(chunks, optimizer)
        return StepResult(metrics, True, float("nan"), 0.0, factor, nonfinite_logits=True)
    skipped, grad_norm, lr, overflow = _optimizer_step(chunks, optimizer, scheduler, factor)
    if not skipped:
        controller.advance()
    return StepResult(metrics, skipped, grad_norm, lr, factor, overflow)


def probe_samples(cfg: JobConfig, mini: int) -> int:
    """Samples per rank the drift probe reads: one micro-batch, or with the interleaved (virtual
    pipeline) schedule, which needs a multiple of PP micro-batches, PP of them; never more than the
    rank's mini-batch (already a valid schedule)."""
    micro = cfg.parallel.pipeline_model_parallel_size if cfg.parallel.virtual_pipeline_model_parallel_size else 1
    return min(mini, micro * cfg.train.micro_batch_size)


def probe_drift(chunks, controller: DPCCController, batch: RLBatch, cfg: JobConfig, *, dp_size: int,
                dp_group, pp_group, vocab_size: int, observe: bool = True) -> float:
    """KL(pi_old || pi_theta) after the iteration's steps on ``batch`` (forward only), fed to the DPCC
    ``controller`` as a drift observation when ``observe`` (``loss.dpcc.drift_probe``); returns it (NaN
    if unusable).

    With one optimizer step per iteration every in-step measurement is the fresh one (~0 by
    construction), so without this the drift score and tau_t never see the step's drift, and the
    monitor's KL rules have no reading (``monitor.step_kl_probe``)."""
    import torch

    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            _, kl, _ = _policy_pass(chunks, controller, batch, cfg, forward_only=True, dp_size=dp_size,
                                    dp_group=dp_group, pp_group=pp_group, vocab_size=vocab_size)
    finally:  # training mode back even if the pass raised (the caller may skip and go on)
        for c in chunks:
            c.train()
    if observe:
        controller.observe(kl, probe=True, advance=False)
    return kl


def sft_update(chunks, optimizer, batch: RLBatch, cfg: JobConfig, *, dp_size: int, dp_group,
               pp_group, vocab_size: int) -> StepResult:
    zero_grads(chunks, optimizer)
    normalizer = global_normalizer(batch, dp_group)
    outputs = run_schedule(chunks, batch.split(cfg.train.micro_batch_size), sft_loss_fn(normalizer),
                           forward_only=False, vocab_size=vocab_size, dp_size=dp_size)
    metrics = reduce_step_metrics(outputs, dp_group, pp_group)
    # The warm-start has its own constant-LR optimizer, discarded before RL starts.
    skipped, grad_norm, lr, overflow = _optimizer_step(chunks, optimizer, None, 1.0)
    return StepResult(metrics, skipped, grad_norm, lr, 1.0, overflow)
