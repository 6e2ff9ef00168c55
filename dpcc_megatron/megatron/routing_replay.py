"""Routing replay (R3) for mixture-of-experts models: the experts each token was routed to in one
forward (the old-policy log-probs, or the sampler) are forced in a later forward (the update), so
the importance ratio compares the same experts. Only the discrete top-k choice is replayed: the
router's scores are recomputed from the live weights, so the gate weights and the router's
gradient are those of the current policy (as Megatron-LM's ``moe_enable_routing_replay``).

It drives the ``RouterReplay`` object Megatron-Core 0.16 gives each router when
``moe_enable_routing_replay`` is set (the model builder sets it for every MoE model), per router
and per micro-batch, never through Megatron's process-global list (several models may live in one
process: policy, reference, converters).

Storage. A batch carries ``routing`` [N, T, L, k] (int16): for each row, target position (the
positions of ``RLBatch.mask``), this rank's MoE layers in order, the k experts. Positions are the
full sequence: under sequence parallelism each TP rank records its shard and the shards are
gathered, and each rank replays its own shard. Padded positions are routed to experts 0..k-1
(they are masked out of every loss, and the model is causal).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def routers(chunk) -> list:
    """The MoE routers of one model chunk, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in getattr(chunk, "module", chunk).modules() if isinstance(m, TopKRouter)]


def _replayer(router):
    rr = getattr(router, "router_replay", None)
    if rr is None:
        raise RuntimeError("the model was built without moe_enable_routing_replay; build it with "
                           "dpcc_megatron.megatron.model.build_gpt_model")
    return rr


def _sp_group(chunk):
    from megatron.core import parallel_state as ps

    cfg = getattr(chunk, "module", chunk).config
    if cfg.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        return ps.get_tensor_model_parallel_group()
    return None


def start_recording(chunk) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for r in routers(chunk):
        rr = _replayer(r)
        rr.clear_indices()
        rr.set_router_replay_action(RouterReplayAction.RECORD)


def collect(chunk, batch_size: int) -> torch.Tensor:
    """The routing the last forward of ``chunk`` recorded, as [b, s, L, k] int16 over the full
    sequence (gathered over TP under sequence parallelism). Call right after the forward."""
    per_layer = []
    for r in routers(chunk):
        idx = _replayer(r).get_recorded_indices()
        if idx is None:
            raise RuntimeError("a router recorded nothing: was start_recording called before the forward?")
        k = idx.shape[-1]
        per_layer.append(idx.reshape(-1, batch_size, k))  # Megatron's tokens are [s, b] flattened
    local = torch.stack(per_layer, dim=2)  # [s_local, b, L, k]
    group = _sp_group(chunk)
    if group is not None:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, dim=0)
    return local.permute(1, 0, 2, 3).to(torch.int16).cpu()


def start_replay(chunk, routing: torch.Tensor) -> None:
    """Force ``routing`` [b, s, L, k] (this chunk's layers, the micro-batch's full padded sequence) in
    the next forward of ``chunk``."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = routers(chunk)
    if routing.shape[2] != len(rs):
        raise ValueError(f"the batch's routing covers {routing.shape[2]} MoE layers, this model chunk has {len(rs)}")
    group = _sp_group(chunk)
    x = routing.permute(1, 0, 2, 3)  # [s, b, L, k]
    if group is not None:
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        x = x.chunk(t, dim=0)[rank]
    device = next(getattr(chunk, "module", chunk).parameters()).device
    for j, r in enumerate(rs):
        rr = _replayer(r)
        rr.clear_indices()  # one target at a time (no recompute of the router in backward)
        rr.set_target_indices(x[:, :, j].reshape(-1, x.shape[-1]).to(device=device, dtype=torch.long))
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def stop(chunk) -> None:
    for r in routers(chunk):
        rr = getattr(r, "router_replay", None)
        if rr is not None:
            rr.clear_router_replay_action()


def pad_routing(routing: torch.Tensor, extra: int) -> torch.Tensor:
    """``extra`` more positions, each routed to experts 0..k-1."""
    n, _, layers, k = routing.shape
    filler = torch.arange(k, dtype=routing.dtype).expand(n, extra, layers, k)
    return torch.cat([routing, filler], dim=1)


def routing_matrix(rows: list, targets: int) -> torch.Tensor:
    """[N, targets, L, k] from per-sample routing of their input positions (``Generation.routing``: [n_i, L,
    k] each); the positions past a sample's end are routed to experts 0..k-1, as :func:`pad_routing`."""
    layers, k = rows[0].shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(rows), targets, layers, k).clone()
    for i, r in enumerate(rows):
        if r.shape[1:] != (layers, k) or r.shape[0] > targets:
            raise ValueError(f"routing of sample {i} is {tuple(r.shape)}, expected at most {targets} positions "
                             f"of {layers} MoE layers x top-{k}")
        out[i, :r.shape[0]] = r.to(torch.int16)
    return out


__all__ = ["collect", "pad_routing", "routers", "routing_matrix", "start_recording", "start_replay", "stop"]
