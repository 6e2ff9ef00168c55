"""Mixture-of-experts bookkeeping for the record: per-layer expert load, dropped tokens, and the
router's auxiliary losses reported separately from the policy loss.

The auxiliary losses themselves are in the objective already: Megatron-Core's router attaches
``moe_aux_loss_coeff * load_balancing_loss`` and ``moe_z_loss_coeff * z_loss`` to the activations
(``MoEAuxLossAutoScaler``), and the pipeline schedule scales them by 1 / micro-batches, so the
gradient is that of ``policy loss + coeff * mean over micro-batches (and data-parallel ranks)``.
This module only reads what happened:

- a forward hook on every router counts, per global layer, the (token, expert) assignments kept
  after the capacity limit (``routing_map``) and the assignments made (tokens x top-k); the
  difference is the dropped tokens;
- Megatron's aux-loss tracker gives each layer's unscaled load-balancing loss and z-loss.

Counts are summed over every rank: in training each token is routed on exactly one rank (MoE at
TP > 1 requires sequence parallelism, each data-parallel rank has its own rows, and pipeline
stages hold different layers).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..distributed import any_rank


def _routers(chunks) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in getattr(c, "module", c).modules() if isinstance(m, TopKRouter)]


def is_moe(chunks) -> bool:
    return getattr(getattr(chunks[0], "module", chunks[0]).config, "num_moe_experts", None) is not None


class RouterStats:
    """Per-layer routing counts of the forwards run inside :func:`router_stats`."""

    def __init__(self, num_layers: int, num_experts: int, topk: int):
        self.kept = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.assigned = torch.zeros(num_layers, dtype=torch.float64)
        self.topk = topk
        self.micro_batches = 0

    def hook(self, router, inputs, output) -> None:
        _, routing_map = output
        layer = router.layer_number - 1  # global, 1-based in Megatron
        self.kept[layer] += routing_map.detach().sum(0).to(self.kept.device, torch.float64)
        self.assigned[layer] += routing_map.shape[0] * self.topk


@contextlib.contextmanager
def router_stats(chunks) -> Iterator[Optional[RouterStats]]:
    """Count routing in the forwards run inside; yields None for a dense model. Also clears
    Megatron's aux-loss tracker on entry, so :func:`moe_metrics` sees only these forwards."""
    if not is_moe(chunks):
        yield None
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    cfg = getattr(chunks[0], "module", chunks[0]).config
    stats = RouterStats(cfg.num_layers, cfg.num_moe_experts, cfg.moe_router_topk)
    # Emptied, not zeroed: a loss the forwards inside do not compute (forward-only, coefficient 0)
    # is then absent rather than reported as 0.
    get_moe_layer_wise_logging_tracker().clear()
    handles = [r.register_forward_hook(stats.hook) for r in _routers(chunks)]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def load_summary(kept: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per layer: max/mean expert load (1 = perfectly balanced) and the load's entropy normalised to
    [0, 1] (1 = uniform). A layer that routed nothing reports 1 and 1."""
    total = kept.sum(-1, keepdim=True)
    share = torch.where(total > 0, kept / total.clamp(min=1e-12), torch.full_like(kept, 1.0 / kept.shape[-1]))
    max_over_mean = share.max(-1).values * kept.shape[-1]
    entropy = -(share * share.clamp(min=1e-30).log()).sum(-1) / math.log(kept.shape[-1])
    return {"max_over_mean": max_over_mean, "entropy": entropy}


def moe_metrics(stats: Optional[RouterStats], *, dp_group, pp_group, num_micro_batches: int,
                tp_group=None) -> dict[str, float]:
    """Collective over the whole job: the record's MoE metrics of the forwards ``stats`` saw.

    - ``moe_load_max_over_mean`` / ``moe_load_entropy``: the worst layer (largest max/mean, lowest
      entropy); per layer as ``moe_load_max_over_mean_l{i}`` / ``moe_load_entropy_l{i}``;
    - ``moe_dropped_tokens`` (assignments over capacity, all layers), ``moe_dropped_frac``;
    - ``moe_load_balancing_loss`` / ``moe_z_loss``: unscaled, mean over layers and micro-batches,
      where their coefficients are > 0 (the objective holds coeff x these)."""
    if stats is None:
        return {}
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tp_group = ps.get_tensor_model_parallel_group() if tp_group is None else tp_group
    counts = torch.cat([stats.kept, stats.assigned.unsqueeze(-1)], dim=-1)
    if torch.cuda.is_available():
        counts = counts.cuda()
    if dist.is_initialized():
        dist.all_reduce(counts)  # every rank routes its own tokens (see the module docstring)
    counts = counts.cpu()
    kept, assigned = counts[:, :-1], counts[:, -1]
    summary = load_summary(kept)
    dropped = float((assigned - kept.sum(-1)).sum())
    out = {"moe_load_max_over_mean": float(summary["max_over_mean"].max()),
           "moe_load_entropy": float(summary["entropy"].min()),
           "moe_dropped_tokens": dropped, "moe_dropped_frac": dropped / max(float(assigned.sum()), 1.0)}
    for i in range(kept.shape[0]):
        out[f"moe_load_max_over_mean_l{i}"] = float(summary["max_over_mean"][i])
        out[f"moe_load_entropy_l{i}"] = float(summary["entropy"][i])
    tracker = get_moe_layer_wise_logging_tracker()
    for name in ("load_balancing_loss", "z_loss"):
        values = torch.zeros(kept.shape[0], dtype=torch.float64)
        if name in tracker:
            values = tracker[name]["values"].detach().to(torch.float64).cpu()
        values = _reduce_aux(values, name, tp_group, dp_group, pp_group)
        if any_rank(name in tracker):  # collective on every rank
            out[f"moe_{name}"] = float(values.sum()) / (kept.shape[0] * max(num_micro_batches, 1))
    return out


# How the step metrics above combine over a record's optimizer steps (algo.metrics.combine_metrics).
MOE_REDUCTIONS = {"moe_load_max_over_mean": ("max", None), "moe_load_entropy": ("min", None),
                  "moe_dropped_tokens": ("sum", None), "moe_dropped_frac": ("mean", None),
                  "moe_load_balancing_loss": ("mean", None), "moe_z_loss": ("mean", None)}


def moe_reductions(keys) -> dict:
    """:data:`MOE_REDUCTIONS` plus the per-layer keys among ``keys`` (worst step per layer)."""
    out = dict(MOE_REDUCTIONS)
    for key in keys:
        if key.startswith("moe_load_max_over_mean_l"):
            out[key] = ("max", None)
        elif key.startswith("moe_load_entropy_l"):
            out[key] = ("min", None)
    return out


def moe_record_fields(merged: dict) -> dict:
    """The MoE fields of an iteration's record, from its combined step metrics."""
    return {k: float(v) for k, v in merged.items() if k.startswith("moe_")}


def _reduce_aux(values: torch.Tensor, name: str, tp_group, dp_group, pp_group) -> torch.Tensor:
    """The tracker's per-layer sums over this rank's micro-batches, as the job's values.

    Under sequence parallelism each TP rank routes a shard of the tokens: its load-balancing
    term is a partial sum of the layer's loss (summed over TP), its z-loss a mean over its
    shard (averaged over TP). Data-parallel ranks average; pipeline stages hold disjoint layers."""
    if not dist.is_initialized():
        return values
    device = "cuda" if torch.cuda.is_available() else "cpu"
    v = values.to(device)
    tp = dist.get_world_size(tp_group)
    if tp > 1:
        dist.all_reduce(v, group=tp_group)
        if name == "z_loss":
            v /= tp
    dp = dist.get_world_size(dp_group)
    if dp > 1:
        dist.all_reduce(v, group=dp_group)
        v /= dp
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(v, group=pp_group)
    return v.cpu()


__all__ = ["MOE_REDUCTIONS", "RouterStats", "is_moe", "load_summary", "moe_metrics", "moe_record_fields",
           "moe_reductions", "router_stats"]
