"""Rollout generation with the Megatron-Core policy itself, at the training TP/PP layout.

    rollout = generate(model_chunks, prompts, max_new_tokens=16, eos_id=tok.eos_id, pad_id=tok.pad_id,
                       vocab_size=tok.vocab_size, temperature=1.0, top_p=1.0, top_k=0, generator=g,
                       tp_group=ps.get_tensor_model_parallel_group(),
                       pp_group=ps.get_pipeline_model_parallel_group())

Every rank of a model-parallel group calls it with the same prompts and an identically seeded
generator, and gets the same :class:`~dpcc_megatron.rollout.Rollout`. The sample is decided once
per model-parallel group: only TP rank 0 of the last pipeline stage draws (from its generator), and
every other rank receives the tokens; the other ranks' generators are never touched, so no rank
can diverge by drawing different noise. Sampling draws ``b x V`` numbers per step, so pass a
generator on the model's device (:func:`rollout_generator`; a CPU one works, but copies the noise).

* **KV cache.** Megatron-Core's own ``StaticInferenceContext`` passed to ``GPTModel.forward``:
  the attention layers write keys/values into it and read the prefix back, which works on CPU
  (gloo, local spec) and at TP > 1 exactly as on GPU. Megatron's engines and controllers around
  it are not used (unified memory, CUDA graphs, Triton); the loop is
  :func:`dpcc_megatron.rollout.decode`, the same code on CPU and GPU.
* **Vocabulary shards.** The last position's logits are gathered over TP by the output layer
  (Megatron requires ``runtime_gather_output`` with an inference context); the padding columns
  ``>= vocab_size`` are dropped before sampling, so they are never drawn.
* **Same tokens on every rank.** TP rank 0 of the last pipeline stage samples and broadcasts the
  column over ``tp_group`` (the other last-stage TP ranks compute the same gathered logits but do
  not sample), then the last stage broadcasts it over ``pp_group``.
* **Pipeline.** One step runs the stages in turn: each non-first stage receives the hidden states
  ``[s, b, h]`` from the previous stage, runs its chunk, and sends to the next (ring order, so
  interleaved chunks work too). Stages idle while others compute: generation is not pipelined.
* **Mixture of experts.** A MoE layer's token dispatcher is collective over the expert group
  (expert TP x EP). Where that group reaches beyond this model-parallel group (EP carved from
  data-parallel replicas, which generate different prompts), the replicas run their forwards in
  lock-step (:class:`_ExpertPeers`): before each forward the group agrees whether anyone still
  decodes, and a replica that finished runs one-token dummy forwards until all have. With
  ``record_routing`` the experts every fed token was routed to are recorded
  (``Rollout.routing``), one column per decode step: the sampler's routing, for routing replay.
* **Sequence parallelism** is switched off for the duration (Megatron's static batching does not
  support it; the weights are the same) and restored afterwards: the config flag and the flag the
  column/row-parallel linears cache (tested on real modules at TP2 x PP2 x VPP2 with SP).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..rollout import Rollout, decode
from ..rollout.loop import StopIds

_SP_ATTRS = ("sequence_parallel", "reduce_scatter_embeddings")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@contextlib.contextmanager
def _generation_mode(chunks: Sequence[torch.nn.Module]):
    """eval(), no autograd, sequence parallelism off; everything restored afterwards."""
    saved_training = [c.training for c in chunks]
    saved_attrs = []
    configs = {id(c.config): c.config for c in chunks}
    saved_config_sp = {k: cfg.sequence_parallel for k, cfg in configs.items()}
    for chunk in chunks:
        for module in chunk.modules():
            for attr in _SP_ATTRS:
                if getattr(module, attr, None) is True:
                    saved_attrs.append((module, attr))
                    setattr(module, attr, False)
    for cfg in configs.values():
        cfg.sequence_parallel = False
    try:
        for c in chunks:
            c.eval()
        with torch.no_grad():
            yield
    finally:
        for c, training in zip(chunks, saved_training):
            c.train(training)
            c.set_input_tensor(None)
        for module, attr in saved_attrs:
            setattr(module, attr, True)
        for k, cfg in configs.items():
            cfg.sequence_parallel = saved_config_sp[k]


class _ExpertPeers:
    """Keeps the forwards of replicas whose MoE layers exchange tokens in lock-step: every forward of
    every rank of ``group`` is preceded by one agreement (:meth:`step`), and a rank done decoding runs
    dummy forwards (:meth:`drain`) while any peer still decodes."""

    def __init__(self, group):
        self.group = group
        self.flag = torch.zeros(1, dtype=torch.int32,
                                device="cuda" if torch.cuda.is_available() else "cpu")

    @staticmethod
    def of(chunks, mp_group) -> Optional["_ExpertPeers"]:
        """The lock-step over the expert group, where it reaches beyond ``mp_group`` (None: not needed)."""
        if getattr(chunks[0].config, "num_moe_experts", None) is None or not dist.is_initialized():
            return None
        from megatron.core import parallel_state as ps

        group = ps.get_expert_tensor_and_model_parallel_group()
        if group is None or dist.get_world_size(group) == 1:
            return None
        mine = set(dist.get_process_group_ranks(mp_group)) if mp_group is not None else {dist.get_rank()}
        if set(dist.get_process_group_ranks(group)) <= mine:
            return None  # the whole expert group decodes the same prompts in step already
        return _ExpertPeers(group)

    def _any(self, active: bool) -> bool:
        self.flag.fill_(1 if active else 0)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.flag.item())

    def step(self) -> None:
        self._any(True)

    def drain(self, dummy_forward) -> int:
        """Dummy forwards until no peer decodes; returns how many ran."""
        n = 0
        while self._any(False):
            dummy_forward()
            n += 1
        return n


class _Stepper:
    """Runs this rank's chunks for one decode step; see the module docstring."""

    def __init__(self, chunks, *, batch: int, width: int, vocab_size: int, pp_group, use_kv_cache: bool,
                 peers: Optional[_ExpertPeers] = None, record_routing: bool = False):
        self.chunks = chunks
        self.peers = peers
        self.routing = None
        if record_routing:
            from . import routing_replay

            layers = sum(len(routing_replay.routers(c)) for c in chunks)
            k = chunks[0].config.moe_router_topk
            self.routing = torch.zeros((batch, width, layers, k), dtype=torch.int16)
            self.row_of_cache = torch.arange(batch)  # cache row -> batch row
        self.vocab_size = vocab_size
        self.contexts = [None] * len(chunks)
        if use_kv_cache:
            try:
                from megatron.core.inference.contexts import StaticInferenceContext
            except ImportError as e:  # pragma: no cover - depends on the installed megatron-core
                raise RuntimeError("this megatron-core has no StaticInferenceContext; use use_kv_cache=False") from e
            self.contexts = [StaticInferenceContext(batch, width) for _ in chunks]
        self.pp_group = pp_group
        if _group_size(pp_group) > 1:
            rank, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
            self.prev = dist.get_global_rank(pp_group, (rank - 1) % size)
            self.next = dist.get_global_rank(pp_group, (rank + 1) % size)
        cfg = chunks[0].config
        self.hidden_size = cfg.hidden_size
        self.dtype = cfg.pipeline_dtype or cfg.params_dtype

    def forward(self, prefix: torch.Tensor, start: int) -> Optional[torch.Tensor]:
        cached = self.contexts[0] is not None
        first = start if cached else 0
        tokens = prefix[:, first:]
        b, s = tokens.shape
        positions = torch.arange(first, first + s, device=tokens.device).unsqueeze(0).expand(b, s)
        if self.peers is not None:
            self.peers.step()
        logits, sends, recorded = None, [], []
        for chunk, ctx in zip(self.chunks, self.contexts):
            hidden_in = None
            if not chunk.pre_process:
                hidden_in = torch.empty((s, b, self.hidden_size), dtype=self.dtype, device=tokens.device)
                dist.recv(hidden_in, src=self.prev, group=self.pp_group)
            chunk.set_input_tensor(hidden_in)
            out = self._run(chunk, tokens, positions, ctx, recorded)
            if ctx is not None:
                ctx.sequence_len_offset += s
                ctx.enable_decode_mode()
            if chunk.post_process:
                logits = out[:, -1, :self.vocab_size].float()
            else:
                out = out.to(self.dtype).contiguous()
                sends.append((dist.isend(out, dst=self.next, group=self.pp_group), out))
        for request, _ in sends:
            request.wait()
        if self.routing is not None and recorded:
            rows = self.row_of_cache[:b]
            self.routing[rows, first:first + s] = torch.cat(recorded, dim=2)
        return logits

    def _run(self, chunk, tokens, positions, ctx, recorded: list):
        if self.routing is None:
            return chunk(tokens, positions, None, inference_context=ctx, runtime_gather_output=True)
        from . import routing_replay

        routing_replay.start_recording(chunk)
        try:
            out = chunk(tokens, positions, None, inference_context=ctx, runtime_gather_output=True)
            if routing_replay.routers(chunk):
                recorded.append(routing_replay.collect(chunk, tokens.shape[0]))  # [b, s, layers, k]
        finally:
            routing_replay.stop(chunk)
        return out

    def recorded_routing(self) -> Optional[torch.Tensor]:
        return self.routing

    def reorder(self, order: torch.Tensor) -> None:
        if self.routing is not None:
            self.row_of_cache = self.row_of_cache[order.cpu()]
        for ctx in self.contexts:
            if ctx is None or not ctx.key_value_memory_dict:
                continue
            rest = torch.arange(len(order), ctx.max_batch_size, device=order.device)
            ctx.swap_key_value_dict(torch.cat([order, rest]))


class _Channel:
    """Broadcast the sampler's tensor: TP rank 0 of the last stage -> its TP group -> the PP group.

    ``is_sampler`` is true on exactly one rank per model-parallel group (TP rank 0 of the last
    stage): it alone draws, so the sample is decided once per TP group."""

    def __init__(self, last_stage: bool, tp_group, pp_group):
        self.last_stage = last_stage
        self.tp_group = tp_group if _group_size(tp_group) > 1 else None
        self.pp_group = pp_group if _group_size(pp_group) > 1 else None
        self.is_sampler = last_stage and (self.tp_group is None or dist.get_rank(tp_group) == 0)
        if self.tp_group is not None:
            self.tp_src = dist.get_global_rank(tp_group, 0)
        if self.pp_group is not None:
            self.pp_src = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)

    def share(self, value: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        buf = like if value is None else value.contiguous()
        if self.last_stage and self.tp_group is not None:
            dist.broadcast(buf, src=self.tp_src, group=self.tp_group)
        if self.pp_group is not None:
            dist.broadcast(buf, src=self.pp_src, group=self.pp_group)
        return buf


def model_device(model_chunks) -> torch.device:
    """The device of this rank's model parameters."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return next(unwrap(chunks[0]).parameters()).device


def rollout_generator(model_chunks, seed: int) -> torch.Generator:
    """A generator on the model's device, seeded: the sampler draws its noise where the logits are
    (no ``b x V`` host-to-device copy per decode step). Only the sampling rank consumes it."""
    return torch.Generator(device=model_device(model_chunks)).manual_seed(seed)


def generate(model_chunks, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: StopIds,
             pad_id: int, vocab_size: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             generator: Optional[torch.Generator] = None, tp_group=None, pp_group=None,
             batch_size: Optional[int] = None, use_kv_cache: bool = True, record_routing: bool = False,
             mp_group=None) -> Rollout:
    """Generate one response per prompt with this rank's model chunks (repeat a prompt G times for a group).

    ``model_chunks``: a ``GPTModel`` or this rank's list of chunks (VPP), possibly wrapped in DDP.
    ``eos_id``: one stop id or a collection of them (e.g. ``tokenizer.stop_ids``), or None.
    ``vocab_size``: the tokenizer's (unpadded) vocabulary. ``temperature == 0`` is greedy;
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``generator`` (required when sampling)
    may live on any device. ``tp_group`` / ``pp_group``: this rank's groups (None: not split).
    ``batch_size``: sequences per KV-cache batch (None: all). ``use_kv_cache=False`` recomputes
    the whole prefix each step (a reference for tests). Leaves the chunks in their previous mode.
    ``record_routing`` (mixture of experts): ``Rollout.routing`` holds the experts each fed token was
    routed to (this rank's MoE layers). ``mp_group``: this rank's model-parallel group (a MoE model whose
    expert group reaches beyond it decodes in lock-step with the other replicas; None: TP x PP from
    Megatron's state where the model has experts).
    """
    chunks = [unwrap(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    limit = chunks[0].max_sequence_length
    if longest > limit:
        raise ValueError(f"longest prompt + max_new_tokens = {longest} exceeds the model's max_sequence_length "
                         f"{limit}; truncate prompts or lower max_new_tokens")
    padded = chunks[-1].vocab_size
    if vocab_size > padded:
        raise ValueError(f"vocab_size {vocab_size} exceeds the model's padded vocabulary {padded}")
    device = next(chunks[0].parameters()).device

    if record_routing and getattr(chunks[0].config, "num_moe_experts", None) is None:
        raise ValueError("record_routing needs a mixture-of-experts model")
    if mp_group is None and getattr(chunks[0].config, "num_moe_experts", None) is not None and dist.is_initialized():
        from megatron.core import parallel_state as ps

        mp_group = ps.get_model_parallel_group()
    peers = _ExpertPeers.of(chunks, mp_group)

    def new_stepper(batch: int, width: int) -> _Stepper:
        return _Stepper(chunks, batch=batch, width=width, vocab_size=vocab_size, pp_group=pp_group,
                        use_kv_cache=use_kv_cache, peers=peers, record_routing=record_routing)

    channel = _Channel(bool(chunks[-1].post_process), tp_group, pp_group)
    with _generation_mode(chunks):
        try:
            out = decode(new_stepper, channel, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id,
                         pad_id=pad_id, vocab_size=vocab_size, temperature=temperature, top_p=top_p, top_k=top_k,
                         generator=generator, batch_size=batch_size, device=device)
        except Exception:
            if peers is not None:  # peers still decoding are not left waiting; this error is the one raised
                with contextlib.suppress(Exception):
                    _drain(peers, chunks, vocab_size, pp_group, device)
            raise
        if peers is not None:
            _drain(peers, chunks, vocab_size, pp_group, device)
        return out


def _drain(peers: _ExpertPeers, chunks, vocab_size: int, pp_group, device) -> int:
    """One-token dummy forwards (no KV cache) while an expert peer still decodes."""
    idle = _Stepper(chunks, batch=1, width=1, vocab_size=vocab_size, pp_group=pp_group, use_kv_cache=False)
    dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
    return peers.drain(lambda: idle.forward(dummy, 0))
