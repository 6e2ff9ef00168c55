"""RL micro-batches through Megatron's pipeline schedule.

One code path serves three passes:
- forward-only log-probs (old policy, reference policy),
- the policy-loss update (any registered loss from :mod:`dpcc_megatron.algo`),
- the supervised warm-start (negative log-likelihood of the response).

Exact normalisation. Megatron's schedule divides each micro-batch loss by the number
of micro-batches and DDP averages gradients over the data-parallel ranks. Our losses
instead return exact *contributions* to the full mini-batch loss (each micro-batch
divides by the global counts of a :class:`~dpcc_megatron.algo.LossNormalizer`), so we
pre-multiply by ``num_microbatches * dp_size``; Megatron's averaging cancels it and the
result equals one rank on the full batch, for token-mean and sequence-mean losses alike.

Layout. ``tokens`` [N, L] hold prompt + response; per-token tensors ([N, L-1]) are
aligned with the *targets* ``tokens[:, 1:]``: position t scores token t+1.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..algo import LossNormalizer, combine_metrics, get_policy_loss
from ..algo.decoupled import decoupled_loss
from ..config import LossConfig
from . import routing_replay
from .rl_batch import RLBatch
from .vocab_parallel import vocab_parallel_token_stats


def sequence_multiple(tp: int, sequence_parallel: bool, fp8: bool) -> int:
    """What the sequence length through the model must be a multiple of: TP under sequence
    parallelism (activations are reduce-scattered along the sequence), 16 with FP8 (TE's GEMM
    dimension rule), both when both are on."""
    m = tp if (sequence_parallel and tp > 1) else 1
    if fp8:
        m = math.lcm(m, 16)
    return m


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


# loss_fn(logprobs [n, L-1] fp32 with grad, entropy [n, L-1], batch) -> (contribution, metrics)
LossFn = Callable[[torch.Tensor, torch.Tensor, RLBatch], tuple[torch.Tensor, dict]]


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def schedule_sequence_multiple(chunks) -> int:
    """:func:`sequence_multiple` for these chunks' Megatron config."""
    cfg = _unwrap(chunks[0]).config
    return sequence_multiple(cfg.tensor_model_parallel_size, bool(cfg.sequence_parallel),
                             getattr(cfg, "fp8", None) is not None)


def run_schedule(chunks, micro_batches: list[RLBatch], loss_fn: LossFn, *, forward_only: bool,
                 vocab_size: int, dp_size: int, with_entropy: bool = True,
                 record_routing: Optional[list] = None) -> list[dict]:
    """Run the micro-batches through ``get_forward_backward_func``; returns the last stage's outputs.

    Sequences are right-padded to :func:`schedule_sequence_multiple` target positions (masked out),
    so ``loss_fn`` and the returned per-token outputs may be longer than the inputs'. With
    several chunks (virtual pipeline) each chunk gets its own iterator over the same micro-batches.

    Routing replay (MoE): a micro-batch carrying ``routing`` has those experts forced; with
    ``record_routing`` (a list) the routing of every micro-batch is appended to it, per chunk, in
    schedule order, as (chunk index, micro-batch index, [b, T, L, k])."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.core.utils import get_model_config

    n_micro = len(micro_batches)
    # Token-budget micro-batches differ in shape: each is padded on its own (to the sequence
    # multiple SP/FP8 need), and the pipeline's p2p then sends shapes first.
    multiple = schedule_sequence_multiple(chunks)
    micro_batches = [mb.pad_targets(padded_length(mb.tokens.shape[1] - 1, multiple)) for mb in micro_batches]
    variable = any(mb.tokens.shape != micro_batches[0].tokens.shape for mb in micro_batches)
    seq_len = max(mb.tokens.shape[1] for mb in micro_batches) - 1
    mbs = max(mb.tokens.shape[0] for mb in micro_batches)
    if len(chunks) > 1 and variable:
        raise ValueError("train.max_tokens_per_micro_batch (micro-batches of different shapes) is not supported "
                         "with the interleaved (virtual pipeline) schedule")
    if len(chunks) > 1 and n_micro % ps.get_pipeline_model_parallel_world_size():
        raise ValueError(f"the interleaved (virtual pipeline) schedule needs the number of micro-batches "
                         f"({n_micro}) to be a multiple of pipeline_model_parallel_size="
                         f"{ps.get_pipeline_model_parallel_world_size()}: adjust train.mini_batch_size / "
                         f"train.micro_batch_size")
    tp_group = ps.get_tensor_model_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    it = iter(micro_batches) if len(chunks) == 1 else [iter(micro_batches) for _ in chunks]

    seen = [0] * len(chunks)
    replaying = any(mb.routing is not None for mb in micro_batches)
    # Each chunk's MoE layers within this rank's routing (several chunks under virtual pipelining).
    offsets = [0]
    for c in chunks if (replaying or record_routing is not None) else ():
        offsets.append(offsets[-1] + len(routing_replay.routers(c)))

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        tokens = mb.tokens.to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
        chunk_index = next(i for i, c in enumerate(chunks) if c is model)
        if mb.routing is not None:
            routing_replay.start_replay(model, mb.routing[:, :, offsets[chunk_index]:offsets[chunk_index + 1]])
        elif record_routing is not None:
            routing_replay.start_recording(model)
        try:
            output = model(inputs, pos, attention_mask=None)
            if record_routing is not None and mb.routing is None:
                record_routing.append((chunk_index, seen[chunk_index],
                                       routing_replay.collect(model, inputs.shape[0])))
        finally:
            if mb.routing is not None or record_routing is not None:
                routing_replay.stop(model)
        seen[chunk_index] += 1

        def loss_func(logits):
            # logits: [n, L-1, V/tp] on the last stage; the op accumulates in fp32 chunk by chunk.
            stats = vocab_parallel_token_stats(logits, targets, group=tp_group, vocab_size=vocab_size,
                                               with_entropy=with_entropy)
            contribution, metrics = loss_fn(stats.logprobs, stats.entropy, mb)
            metrics = dict(metrics)
            metrics["nonfinite_logits"] = stats.nonfinite.detach().float()
            return contribution * (n_micro * dp_size), metrics

        return output, loss_func

    model_config = get_model_config(chunks[0])
    saved = model_config.variable_seq_lengths
    model_config.variable_seq_lengths = saved or variable
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=it, model=list(chunks), num_microbatches=n_micro,
            seq_length=seq_len, micro_batch_size=mbs, forward_only=forward_only)
    finally:
        model_config.variable_seq_lengths = saved


def micro_batches(batch: RLBatch, micro_batch_size: int, max_tokens: int = 0):
    """-> (micro-batches, order). ``max_tokens`` 0: rows in order, ``micro_batch_size`` each, padded to
    the batch's length (order None); > 0: token-budget micro-batches (see batching.py)."""
    if not max_tokens:
        return batch.split(micro_batch_size), None
    from .batching import token_budget_micro_batches

    return token_budget_micro_batches(batch, max_tokens)


def compute_logprobs(chunks, batch: RLBatch, *, micro_batch_size: int, vocab_size: int, dp_size: int,
                     train_mode_after: bool = True, max_tokens: int = 0, record_routing: bool = False):
    """Forward-only log-probs and entropies of ``batch`` (last pipeline stage; None elsewhere).

    The chunks run in eval mode and go back to train mode after, unless ``train_mode_after``
    is False (a frozen reference model). ``record_routing`` (MoE, routing replay): a batch that carries
    the sampler's ``routing`` is forwarded with it; otherwise the experts every token was routed to are
    stored in ``batch.routing`` (on every rank, for its own layers). Either way a later forward of
    ``batch`` replays them."""
    from megatron.core import parallel_state as ps

    def collect(logprobs, entropy, mb):
        return torch.zeros((), device=logprobs.device), {"logprobs": logprobs.detach(),
                                                           "entropy": entropy.detach()}

    for c in chunks:
        c.eval()
    # The sampler's routing, where the batch carries it (the Megatron engine records it), is replayed;
    # otherwise these log-probs define the routing. Without record_routing (a reference model) it routes freely.
    replay = record_routing and batch.routing is not None
    record_routing = record_routing and not replay
    recorded: Optional[list] = [] if record_routing else None
    with torch.no_grad():
        parts, order = micro_batches(batch if replay else dataclasses.replace(batch, routing=None),
                                     micro_batch_size, max_tokens)
        if record_routing and order is not None:
            raise ValueError("routing replay records with fixed-size micro-batches; set "
                             "train.max_tokens_per_micro_batch: 0")
        out = run_schedule(chunks, parts, collect, forward_only=True, vocab_size=vocab_size, dp_size=dp_size,
                           record_routing=recorded)
    if record_routing:
        batch.routing = _assemble_routing(recorded, len(chunks), batch.tokens.shape[1] - 1)
    if train_mode_after:
        for c in chunks:
            c.train()
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None, None
    T = batch.tokens.shape[1] - 1  # drop the sequence-parallel padding
    if order is not None:  # token-budget micro-batches: rows back in place, padded to the batch's length
        from .batching import scatter_rows

        return (scatter_rows([o["logprobs"] for o in out], order, T, cut=True),
                scatter_rows([o["entropy"] for o in out], order, T, cut=True))
    return torch.cat([o["logprobs"][:, :T] for o in out]), torch.cat([o["entropy"][:, :T] for o in out])


def _assemble_routing(recorded: list, num_chunks: int, targets: int) -> torch.Tensor:
    """[N, T, L, k] from run_schedule's (chunk, micro-batch, [b, T_pad, L_chunk, k]) records: micro-batches
    in row order, chunks' layers side by side, the sequence-parallel padding dropped."""
    per_chunk = [sorted((m, r) for c, m, r in recorded if c == i) for i in range(num_chunks)]
    return torch.cat([torch.cat([r for _, r in parts])[:, :targets] for parts in per_chunk], dim=2)


def global_normalizer(batch: RLBatch, dp_group, max_len: Optional[int] = None) -> LossNormalizer:
    """Counts of the whole mini-batch across data-parallel ranks (SUM counts, MAX length).

    ``max_len``: T_max of the ``token_sum_norm`` aggregation (Dr. GRPO's generation budget);
    None takes the padded target length of the batch."""
    local = LossNormalizer.from_mask(batch.mask)
    if max_len is not None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        longest = int(batch.mask.sum(-1).max()) if batch.mask.numel() else 0
        if longest > max_len:
            raise ValueError(f"a response has {longest} tokens, more than the generation budget max_len={max_len}")
        local = LossNormalizer(num_tokens=local.num_tokens, num_seqs=local.num_seqs, num_rows=local.num_rows,
                               max_len=int(max_len))
    sums = torch.tensor([local.num_tokens, local.num_seqs, local.num_rows], dtype=torch.float64)
    length = torch.tensor([float(local.max_len)], dtype=torch.float64)
    if torch.cuda.is_available():
        sums, length = sums.cuda(), length.cuda()
    if dist.is_initialized():
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=dp_group)
    return LossNormalizer(num_tokens=float(sums[0]), num_seqs=float(sums[1]), num_rows=float(sums[2]),
                          max_len=int(length[0]))


def policy_loss_fn(loss_cfg: LossConfig, normalizer: LossNormalizer, tis_cap: Optional[float] = None) -> LossFn:
    """The registered policy loss, in its decoupled form (algo/decoupled.py): with ``tis_cap`` (the
    behaviour cap C the run resolved, ``loss.behaviour_is_cap`` or ``precision.tis_cap``) each token's
    loss is multiplied by the truncated IS weight sg(min(pi_old / pi_sampler, C)), pi_old being the
    proximal policy the ratio is taken against and pi_sampler the behaviour policy that sampled.

    The weight is applied by scaling the token's advantage: every registered token loss is
    positively homogeneous in A (l(wA) = w l(A) for w > 0), so this equals weighting the loss
    term while leaving the reference-KL penalty unweighted (tests/megatron/test_precision.py
    checks the identity for every registered loss).
    """
    loss = get_policy_loss(loss_cfg.name)

    def fn(logprobs, entropy, mb: RLBatch):
        if tis_cap is not None and mb.sampler_logprobs is None:
            raise ValueError("precision.tis_cap is set but the batch carries no sampler_logprobs (the behaviour "
                             "importance weight, loss.behaviour_is_cap / precision.tis_cap, needs them)")
        dev = logprobs.device
        contribution, metrics = decoupled_loss(
            loss, logprobs, mb.old_logprobs.to(dev), None if mb.sampler_logprobs is None else mb.sampler_logprobs.to(dev),
            mb.advantages.to(dev), mb.mask.to(dev), loss_cfg, tis_cap, normalizer=normalizer,
            ref_logprobs=None if mb.ref_logprobs is None else mb.ref_logprobs.to(dev))
        weight_metrics = {k: metrics.pop(k) for k in ("tis_weight_mean", "tis_clip_frac") if k in metrics}
        mask = mb.mask.to(dev)
        n = mask.sum().clamp(min=1)
        metrics["entropy"] = (entropy.detach() * mask).sum() / n
        metrics["nll"] = -(logprobs.detach() * mask).sum() / n
        metrics.update(weight_metrics)
        return contribution, metrics

    return fn


def sft_loss_fn(normalizer: LossNormalizer) -> LossFn:
    """Token-mean negative log-likelihood of the response tokens (the warm-start)."""

    def fn(logprobs, entropy, mb: RLBatch):
        mask = mb.mask.to(logprobs.device)
        nll = -(logprobs * mask).sum() / max(normalizer.num_tokens, 1.0)
        n = mask.sum().float()
        return nll, {"pg_loss": nll.detach(), "num_tokens": n,
                     "entropy": (entropy.detach() * mask).sum() / n.clamp(min=1)}

    return fn


EXTRA_REDUCTIONS = {"entropy": ("mean", "num_tokens"), "nll": ("mean", "num_tokens"),
                    "nonfinite_logits": ("sum", None), "tis_weight_mean": ("mean", "num_tokens"),
                    "tis_clip_frac": ("mean", "num_tokens")}


def reduce_step_metrics(outputs: list[dict], dp_group, pp_group) -> dict[str, float]:
    """Combine micro-batch metrics over DP (last stage), then share them with every pipeline stage."""
    from megatron.core import parallel_state as ps

    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    parts = [{k: float(v) for k, v in o.items() if torch.as_tensor(v).numel() == 1} for o in outputs] if last else []
    if dist.is_initialized() and last and dist.get_world_size(dp_group) > 1:
        gathered: list = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(gathered, parts, group=dp_group)
        parts = [p for g in gathered for p in g]
    merged = combine_metrics(parts, EXTRA_REDUCTIONS) if last else {}
    if dist.is_initialized() and dist.get_world_size(pp_group) > 1:
        box = [merged]
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=src, group=pp_group)
        merged = box[0]
    return merged


__all__ = ["RLBatch", "compute_logprobs", "global_normalizer", "micro_batches", "padded_length", "policy_loss_fn",
           "reduce_step_metrics", "run_schedule", "schedule_sequence_multiple", "sequence_multiple",
           "sft_loss_fn"]
