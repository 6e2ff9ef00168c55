"""Gather the training shards into Hugging Face tensors, in memory, for a rollout engine's refit.

    pairs = gather_hf_weights(chunks, model_cfg, vocab_size=tok.vocab_size, dtype=torch.bfloat16,
                              tp_group=..., pp_group=...)
    # [(hf_name, tensor), ...] on the model-parallel group's rank 0 (TP rank 0, first stage); None elsewhere

* **TP.** Parameters Megatron marks ``tensor_model_parallel`` are all-gathered over ``tp_group`` and
  concatenated along their ``partition_dim``. SwiGLU's ``linear_fc1`` is ``[gate_r; up_r]`` on each TP
  rank, so every shard is split in halves and the gates, then the ups, are concatenated. QKV rows
  are grouped per query group and groups are split contiguously, so plain concatenation is right.
* **PP / VPP.** Local ``decoder.layers.i`` of a chunk is global layer ``i + offset``; TP rank 0 of
  each stage sends its full-TP tensors to the first stage (``gather_object`` over ``pp_group``).
* **Names.** Local-spec names become canonical (:func:`dpcc_megatron.convert.layout.canonical_name`)
  and then HF names with the conversion layer's mapping
  (:func:`~dpcc_megatron.convert.layout.canonical_to_hf`), which also drops the padded vocabulary
  rows (the model config passed in carries the real vocabulary size). With tied embeddings the last
  stage's ``output_layer`` copy is not sent.

No disk round trip; every rank of the job must call it (TP and PP groups are collective).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..convert.layout import canonical_name, canonical_to_hf, hf_shapes, unit_of, units
from .reshard import LOCAL_EXPERT, layer_offset, global_expert_name, local_to_global_name


def _size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _gather_tp(t: torch.Tensor, param, name: str, gated: bool, tp_group, everywhere: bool = False,
               meter=None) -> Optional[torch.Tensor]:
    """The full tensor on TP rank 0 (on every TP rank with ``everywhere``; None on the others)."""
    tp = _size(tp_group)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return t if tp == 1 or everywhere or dist.get_rank(tp_group) == 0 else None
    send = t.contiguous()
    if dist.get_backend(tp_group) == "gloo" and send.dtype not in (torch.float32, torch.float64):
        send = send.float()  # gloo's collectives are not guaranteed for bf16/fp16
    parts = [torch.empty_like(send) for _ in range(tp)]
    held = (2 * tp * send.numel() + (send.numel() if send is not t else 0)) * send.element_size()  # parts + cat
    if meter is not None:
        meter.hold(held)
    dist.all_gather(parts, send, group=tp_group)
    if dist.get_rank(tp_group) != 0 and not everywhere:
        if meter is not None:
            meter.release(held)
        return None
    dim = param.partition_dim
    if gated and (name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")):  # also an expert's
        halves = [torch.chunk(p, 2, dim=dim) for p in parts]
        out = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    else:
        out = torch.cat(parts, dim=dim)
    if meter is not None:
        meter.release(held)  # the parts are dropped on return; the caller counts the full tensor it keeps
    return out


def gather_canonical(chunks, tp_group=None, pp_group=None, etp_group=None) -> Optional[dict[str, torch.Tensor]]:
    """The canonical (TP=1/PP=1, global layer index, padded vocabulary) state dict on the first stage's
    TP rank 0; None on every other rank. Experts are gathered over ``etp_group`` (the expert
    tensor-parallel group; None: Megatron's); at expert parallelism > 1 it refuses (each rank holds
    other experts: :class:`HFWeightStream` gathers them)."""
    tp_rank = dist.get_rank(tp_group) if _size(tp_group) > 1 else 0
    if any(_unwrap(c).config.expert_model_parallel_size > 1 for c in chunks):
        raise ValueError("gather_canonical does not gather experts over expert parallelism "
                         "(parallel.expert_model_parallel_size > 1); use HFWeightStream")
    if etp_group is None and any(_unwrap(c).config.num_moe_experts for c in chunks) and dist.is_initialized():
        from megatron.core import parallel_state as ps

        etp_group = ps.get_expert_tensor_parallel_group()
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        while hasattr(chunk, "module"):
            chunk = chunk.module
        offset = layer_offset(chunk)
        tied = getattr(chunk, "share_embeddings_and_output_weights", False)
        gated = bool(chunk.config.gated_linear_unit)
        for name, param in chunk.named_parameters():
            key = local_to_global_name(name, offset)
            if key == "output_layer.weight" and tied:
                continue
            expert = bool(LOCAL_EXPERT.match(name))  # gathered over its own TP group, kept on TP rank 0
            full = _gather_tp(param.detach(), param, name, gated, etp_group if expert else tp_group, everywhere=expert)
            if full is not None and tp_rank == 0:
                local[canonical_name(key)] = full.cpu()
    if tp_rank != 0:
        return None
    if _size(pp_group) == 1:
        return local
    pp_rank = dist.get_rank(pp_group)
    box = [None] * dist.get_world_size(pp_group) if pp_rank == 0 else None
    dist.gather_object(local, box, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
    if pp_rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in box:
        merged.update(part)
    return merged


def canonical_to_hf_pairs(can: dict[str, torch.Tensor], model_cfg: ModelConfig, vocab_size: int,
                          dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs in file order; ``vocab_size`` rows of the embedding/output layer are kept."""
    cfg = dataclasses.replace(model_cfg, vocab_size=vocab_size)
    out = []
    for unit in units(cfg):
        for name, t in canonical_to_hf(cfg, unit, can).items():
            out.append((name, t.to(dtype).contiguous()))
    return out


def gather_hf_weights(chunks, model_cfg: ModelConfig, *, vocab_size: int, dtype: torch.dtype, tp_group=None,
                      pp_group=None) -> Optional[list[tuple[str, torch.Tensor]]]:
    can = gather_canonical(chunks, tp_group, pp_group)
    return None if can is None else canonical_to_hf_pairs(can, model_cfg, vocab_size, dtype)


# -- the streamed refit: one bucket at a time --------------------------------------------------------
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A run of HF tensors of one pipeline stage, laid out in one flat byte buffer."""

    index: int
    stage: int
    """The pipeline rank whose TP ranks gather and convert these tensors."""
    entries: tuple
    """(hf_name, shape, byte offset, nbytes) per tensor, in file order."""
    nbytes: int


def plan_buckets(model_cfg: ModelConfig, vocab_size: int, dtype: torch.dtype, unit_stage: dict,
                 bucket_bytes: int) -> list[Bucket]:
    """HF tensors in file order, packed greedily into buckets of at most ``bucket_bytes`` (a module's
    tensors larger than that are a bucket of their own); a bucket never spans two pipeline stages nor
    splits a serving module's tensors (:func:`module_of`). Identical on every rank."""
    served = dataclasses.replace(model_cfg, vocab_size=vocab_size)
    size = torch.tensor([], dtype=dtype).element_size()
    out, cur, off, stage = [], [], 0, None

    def flush():
        nonlocal cur, off
        if cur:
            out.append(Bucket(len(out), stage, tuple(cur), off))
        cur, off = [], 0

    groups: dict = {}  # tensors of one module (q/k/v, gate/up, a layer's experts) go into one bucket together
    for unit in units(served):
        for name, shape in hf_shapes(served, unit).items():
            groups.setdefault((unit_stage[unit], module_of(name)), []).append((name, tuple(shape)))
    for (s, _), group in groups.items():
        sizes = [size * math.prod(shape) for _, shape in group]
        need = sum(-(-nb // _ALIGN) * _ALIGN for nb in sizes)
        if cur and (s != stage or off + need > bucket_bytes):
            flush()
        stage = s
        for (name, shape), nb in zip(group, sizes):
            cur.append((name, shape, off, nb))
            off += -(-nb // _ALIGN) * _ALIGN
    flush()
    return out


_HF_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.)experts\.(\d+)\.[a-z0-9_]+(?:\.weight)?$")


def module_of(hf_name: str) -> str:
    """The serving module an HF tensor loads into: vLLM fuses q/k/v into one module, gate/up into one and a
    MoE layer's experts into one, and processes a module once all its tensors arrived."""
    base = hf_name.rsplit(".", 1)[0]
    m = _HF_EXPERT.match(base)
    if m:  # vLLM's FusedMoE: every expert of a layer is one module (w13 / w2 stacked over experts)
        return m.group(1) + "experts"
    for fused, parts in ((".self_attn.qkv", (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj")),
                         (".mlp.gate_up", (".mlp.gate_proj", ".mlp.up_proj"))):
        for part in parts:
            if base.endswith(part):
                return base[: -len(part)] + fused
    return base


def owned_units(chunks) -> list:
    """The conversion units (``embedding``, layer indices, ``final``) whose weights this rank's chunks hold."""
    out = []
    for chunk in chunks:
        chunk = _unwrap(chunk)
        offset = layer_offset(chunk)
        if getattr(chunk, "pre_process", False):
            out.append("embedding")
        experts = chunk.config.num_moe_experts or 0  # a layer's experts live on its stage (some on each EP rank)
        for i in range(offset, offset + len(chunk.decoder.layers)):
            out.extend((i, *((i, e) for e in range(experts))))
        if getattr(chunk, "post_process", False):
            out.append("final")
    return out


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class RefitMeter:
    """Bytes of the refit's own memory alive on this rank (gathered shards, converted tensors, bucket
    buffers) and their peak: what a refit adds to the rank's memory beyond its training shards. Parts
    set by name (:meth:`set`) plus transient holds (:meth:`hold` / :meth:`release`)."""

    def __init__(self) -> None:
        self.parts: dict[str, int] = {}
        self.transient = 0
        self.peak = 0

    @property
    def live(self) -> int:
        return sum(self.parts.values()) + self.transient

    def _update(self) -> None:
        self.peak = max(self.peak, self.live)

    def set(self, part: str, nbytes: int) -> None:
        self.parts[part] = int(nbytes)
        self._update()

    def hold(self, nbytes: int) -> None:
        self.transient += int(nbytes)
        self._update()

    def release(self, nbytes: int) -> None:
        self.transient -= int(nbytes)

    def reset_peak(self) -> None:
        self.peak = self.live


def _storage_bytes(tensors, exclude: set) -> int:
    """Bytes of the distinct storages behind ``tensors``, except those whose data pointer is in ``exclude``."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class HFWeightStream:
    """The training shards as HF tensors, streamed bucket by bucket (``rollout.vllm.refit_bucket_mb``).

    For each bucket the TP ranks of the stage owning it all-gather its tensors (one conversion unit, one
    decoder layer at most, at a time), convert them to HF names and layouts, and write them into the
    bucket buffer; with PP > 1 the buffer is then broadcast from that stage over ``pp_group``, so every
    rank of the model-parallel group ends up with the bucket. Nothing else is kept: a rank holds its own
    shards, one bucket buffer and at most one unit's gathered tensors (:attr:`meter` counts them).
    Collective over the TP and PP groups; every rank iterates the same buckets."""

    def __init__(self, model_cfg: ModelConfig, *, vocab_size: int, dtype: torch.dtype, bucket_bytes: int,
                 tp_group=None, pp_group=None, ep_group=None, etp_group=None):
        self.model_cfg = model_cfg
        self.ep_group, self.etp_group = ep_group, etp_group
        """Mixture of experts: the expert-parallel group (each rank holds its experts; every rank of it gets
        them all) and the expert tensor-parallel group (an expert's shards); None: Megatron's, for a model
        with experts."""
        self.served = dataclasses.replace(model_cfg, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.bucket_bytes = int(bucket_bytes)
        self.tp_group, self.pp_group = tp_group, pp_group
        self.meter = RefitMeter()
        self._plan: Optional[list[Bucket]] = None

    def plan(self, chunks) -> list[Bucket]:
        """The buckets (collective over ``pp_group`` the first time: which stage owns which unit)."""
        if self._plan is None:
            self._expert_groups()
            mine = owned_units(chunks)
            if _size(self.pp_group) > 1:
                box = [None] * dist.get_world_size(self.pp_group)
                dist.all_gather_object(box, mine, group=self.pp_group)
            else:
                box = [mine]
            unit_stage = {u: s for s, us in enumerate(box) for u in us}
            self._plan = plan_buckets(self.model_cfg, self.vocab_size, self.dtype, unit_stage, self.bucket_bytes)
        return self._plan

    def max_bucket_bytes(self, chunks) -> int:
        return max(b.nbytes for b in self.plan(chunks))

    def _expert_groups(self) -> None:
        if self.model_cfg.num_moe_experts is None or not dist.is_initialized():
            return
        from megatron.core import parallel_state as ps

        if self.ep_group is None:
            self.ep_group = ps.get_expert_model_parallel_group()
        if self.etp_group is None:
            self.etp_group = ps.get_expert_tensor_parallel_group()

    def _local_experts(self) -> int:
        return self.model_cfg.num_moe_experts // _size(self.ep_group)

    def _params_of(self, chunks) -> dict:
        """unit -> [(local name, canonical name, param)] of this rank's chunks (experts under their global
        index: expert-parallel rank r holds experts r * local .. r * local + local - 1)."""
        out: dict = {}
        ep_rank = dist.get_rank(self.ep_group) if _size(self.ep_group) > 1 else 0
        for chunk in chunks:
            chunk = _unwrap(chunk)
            offset = layer_offset(chunk)
            tied = getattr(chunk, "share_embeddings_and_output_weights", False)
            for name, param in chunk.named_parameters():
                key = local_to_global_name(name, offset)
                if key == "output_layer.weight" and tied:
                    continue
                can = canonical_name(global_expert_name(key, chunk, ep_rank) or key)
                out.setdefault(unit_of(can), []).append((name, can, param, bool(chunk.config.gated_linear_unit)))
        return out

    def _unit_hf(self, unit, params) -> dict[str, torch.Tensor]:
        """The unit's HF tensors (gathered over TP, on every TP rank); the meter's ``unit`` part counts the
        storages they (and the gathered tensors, while converting) add beyond the parameters."""
        own = {p.untyped_storage().data_ptr() for _, _, p, _ in params}
        can = {}
        for name, cname, param, gated in params:
            group = self.etp_group if LOCAL_EXPERT.match(name) else self.tp_group  # an expert's own TP
            can[cname] = _gather_tp(param.detach(), param, name, gated, group, everywhere=True,
                                    meter=self.meter).cpu()
            self.meter.set("unit", _storage_bytes(can.values(), own))
        hf = {n: t.to(self.dtype) for n, t in canonical_to_hf(self.served, unit, can).items()}
        self.meter.set("unit", _storage_bytes(list(can.values()) + list(hf.values()), own))
        del can
        self.meter.set("unit", _storage_bytes(hf.values(), own))
        return hf

    def stream(self, chunks, buffer_for):
        """Yields each :class:`Bucket` once ``buffer_for(bucket)`` (a uint8 tensor of at least
        ``bucket.nbytes``, owned by the caller) holds it on this rank. Collective."""
        plan = self.plan(chunks)
        params = self._params_of(chunks)
        pp_rank = dist.get_rank(self.pp_group) if _size(self.pp_group) > 1 else 0
        unit, hf = None, None
        for bucket in plan:
            buf = buffer_for(bucket)
            if bucket.stage == pp_rank:
                for name, shape, off, nb in bucket.entries:
                    u = unit_of_hf(name)
                    if isinstance(u, tuple) and u not in params:
                        continue  # another expert-parallel rank's expert: broadcast from it below
                    if u != unit:
                        unit, hf = u, None
                        self.meter.set("unit", 0)
                        hf = self._unit_hf(u, params.get(u, []))
                    buf[off:off + nb].view(self.dtype).view(shape).copy_(hf[name])
                for owner, lo, hi in expert_runs(bucket, self._local_experts() if _size(self.ep_group) > 1 else 0):
                    dist.broadcast(buf[lo:hi], src=dist.get_global_rank(self.ep_group, owner), group=self.ep_group)
            if _size(self.pp_group) > 1:
                dist.broadcast(buf[:bucket.nbytes], src=dist.get_global_rank(self.pp_group, bucket.stage),
                               group=self.pp_group)
            yield bucket
        hf = None
        self.meter.set("unit", 0)


def expert_runs(bucket: Bucket, local_experts: int) -> list[tuple[int, int, int]]:
    """(expert-parallel owner, first byte, end byte) of each run of consecutive expert tensors in ``bucket``
    held by one expert-parallel rank (expert e lives on rank e // ``local_experts``); [] when 0 (no EP)."""
    runs: list = []
    if not local_experts:
        return runs
    previous = None  # the owner of the previous entry (None: not an expert's)
    for name, _, off, nb in bucket.entries:
        u = unit_of_hf(name)
        owner = u[1] // local_experts if isinstance(u, tuple) else None
        if owner is not None and owner == previous:
            runs[-1][2] = off + nb  # (with the alignment padding before it)
        elif owner is not None:
            runs.append([owner, off, off + nb])
        previous = owner
    return [tuple(r) for r in runs]


def unit_of_hf(hf_name: str):
    """The conversion unit an HF tensor name belongs to."""
    m = _HF_EXPERT.match(hf_name)
    if m:
        return int(m.group(2)), int(m.group(3))
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2])
    if hf_name == "model.embed_tokens.weight":
        return "embedding"
    return "final"
