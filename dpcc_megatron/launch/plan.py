"""Plan a layout for a job config: check it divides, estimate per-GPU memory, rank alternatives.

    p = plan_layout(cfg, PlanOptions(gpus=64, tp=4, pp=8, vpp=5))
    p.fits, p.peak_gib, p.problems
    best = search_layouts(cfg, PlanOptions(gpus=64))[0]

The arithmetic lives in :mod:`.memory` and :mod:`.throughput`; this module maps the config
tree onto it and knows Megatron's divisibility rules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .memory import (GIB, RECOMPUTE, Layout, ModelShape, StageMemory, Workload, estimate, peak_stage,
                     vllm_engine_problems)
from .throughput import Hardware, IterationTime, iteration_time


@dataclass(frozen=True)
class PlanOptions:
    """What the command line adds to (or overrides in) the config."""

    gpus: Optional[int] = None
    """World size; None: one model replica (TP x PP x CP)."""
    tp: Optional[int] = None
    pp: Optional[int] = None
    vpp: Optional[int] = None
    """0 switches interleaving off; None keeps the config's."""
    cp: int = 1
    """Context parallelism (not a config key yet): splits the sequence."""
    recompute: Optional[str] = None
    """none | selective | full; None: the config's parallel.recompute_granularity, else none."""
    micro_batch: Optional[int] = None
    sequence_parallel: Optional[bool] = None
    ep: Optional[int] = None
    """Expert parallel size; None: the config's parallel.expert_model_parallel_size."""
    reserve_gib: float = 4.0
    logits_chunk: int = 1024
    hardware: Hardware = field(default_factory=Hardware)


@dataclass
class Plan:
    layout: Layout
    work: Workload
    model: ModelShape
    stages: list[StageMemory]
    problems: list[str]
    gpu_mem_gib: float
    time: IterationTime
    samples: int
    """Sequences per RL iteration (prompts_per_iteration x group_size)."""

    @property
    def peak(self) -> StageMemory:
        return peak_stage(self.stages)

    @property
    def peak_gib(self) -> float:
        return self.peak.peak / GIB

    @property
    def fits_memory(self) -> bool:
        return self.peak_gib <= self.gpu_mem_gib

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Modelled throughput of whole RL iterations (rollout, log-probs, optimizer steps)."""
        return self.samples * self.work.seq_len / self.time.total_s / self.layout.gpus

    @property
    def fits(self) -> bool:
        return not self.problems and self.fits_memory

    def reasons(self) -> list[str]:
        """Why it does not fit: layout problems, then the memory overrun with its largest terms."""
        out = list(self.problems)
        if not self.fits_memory:
            top = sorted(self.peak.terms, key=lambda x: -x.bytes)[:3]
            out.append(f"needs {self.peak_gib:.1f} GiB on pipeline stage {self.peak.stage} "
                       f"> {self.gpu_mem_gib:g} GiB per GPU; largest terms: "
                       + ", ".join(f"{x.name} {x.gib:.1f} GiB" for x in top))
        return out

    def summary(self) -> dict[str, Any]:
        L = self.layout
        return {"fits": self.fits, "peak_gib_per_gpu": round(self.peak_gib, 2), "peak_stage": self.peak.stage,
                "peak_phase": self.peak.peak_phase, "gpu_mem_gib": self.gpu_mem_gib, "gpus": L.gpus,
                "tp": L.tp, "pp": L.pp, "vpp": L.vpp, "cp": L.cp, "dp": L.dp, "ep": L.ep, "etp": L.expert_tp,
                "sequence_parallel": L.sequence_parallel, "distributed_optimizer": L.distributed_optimizer,
                "recompute": self.work.recompute, "micro_batch": self.work.micro_batch,
                "num_microbatches": self.work.num_microbatches,
                "bubble": round(self.time.step.bubble, 4), "iteration_s": round(self.time.total_s, 2),
                "rollout_s": round(self.time.rollout_s, 2), "train_step_s": round(self.time.step.total_s, 3),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
                "problems": self.reasons()}


def model_shape(model: Any) -> ModelShape:
    """The memory-relevant numbers of a ``ModelConfig``."""
    return ModelShape(
        num_layers=model.num_layers, hidden=model.hidden_size,
        ffn=model.ffn_hidden_size or 4 * model.hidden_size, heads=model.num_attention_heads,
        kv_groups=model.num_query_groups or model.num_attention_heads,
        head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
        vocab=model.vocab_size, vocab_divisor=model.make_vocab_size_divisible_by, swiglu=model.swiglu,
        tied_embeddings=model.tie_embeddings, layernorm=model.normalization == "LayerNorm",
        qkv_bias=model.add_qkv_bias, linear_bias=model.add_bias_linear,
        learned_positions=model.max_seq_len if model.position_embedding_type == "learned_absolute" else 0,
        **_moe_shape(model))


def _moe_shape(model: Any) -> dict:
    experts = getattr(model, "num_moe_experts", None)
    out = {"qk_norm": bool(getattr(model, "qk_layernorm", False))}
    if experts:
        out.update(experts=experts, topk=model.moe_router_topk,
                   expert_ffn=model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size)
    return out


def training_seq_len(cfg: Any) -> int:
    """Prompt + response, capped by the model's context."""
    return min(cfg.model.max_seq_len, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)


def layout_problems(cfg: Any, layout: Layout, gpus: int, micro: int) -> list[str]:
    """Every reason Megatron or the trainer would refuse this layout, naming the config keys."""
    m, t, p, v = cfg.model, layout.tp, layout.pp, layout.vpp
    shape = model_shape(m)
    out: list[str] = []
    replica = t * p * layout.cp
    if gpus % replica:
        out.append(f"{gpus} GPUs are not divisible by TP x PP x CP = {t} x {p} x {layout.cp} = {replica}")
    for key, value in (("num_attention_heads", shape.heads), ("num_query_groups", shape.kv_groups),
                       ("ffn_hidden_size", shape.ffn)):
        if value % t:
            out.append(f"model.{key}={value} is not divisible by tensor_model_parallel_size={t}")
    if v is not None and p == 1:
        out.append("virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1")
    if shape.num_layers % (p * (v or 1)):
        what = f"pipeline_model_parallel_size={p}" + (f" x virtual_pipeline_model_parallel_size={v}" if v else "")
        out.append(f"model.num_layers={shape.num_layers} is not divisible by {what}")
    if layout.sequence_parallel and t == 1:
        out.append("sequence_parallel needs tensor_model_parallel_size > 1")
    out += _expert_problems(shape, layout, gpus)
    seq = training_seq_len(cfg)
    if layout.cp > 1 and seq % (2 * layout.cp):
        out.append(f"training sequence {seq} is not divisible by 2 x CP = {2 * layout.cp}")
    if not out:  # the batch rules need a valid DP size
        d, r, tr = layout.dp, cfg.rollout, cfg.train
        samples = r.prompts_per_iteration * r.group_size
        if r.prompts_per_iteration % d:
            out.append(f"rollout.prompts_per_iteration={r.prompts_per_iteration} is not divisible by the "
                       f"data-parallel size {d}")
        if samples % tr.mini_batch_size:
            out.append(f"prompts_per_iteration x group_size = {samples} is not a multiple of "
                       f"train.mini_batch_size={tr.mini_batch_size}")
        if tr.mini_batch_size % (d * micro):
            out.append(f"train.mini_batch_size={tr.mini_batch_size} is not a multiple of data-parallel size "
                       f"{d} x micro-batch {micro}")
        elif v is not None and (tr.mini_batch_size // (d * micro)) % p:
            out.append(f"virtual_pipeline_model_parallel_size={v}: the interleaved schedule needs the "
                       f"micro-batches per step, train.mini_batch_size / (DP {d} x train.micro_batch_size "
                       f"{micro}) = {tr.mini_batch_size // (d * micro)}, to be a multiple of "
                       f"pipeline_model_parallel_size={p}")
    return out


def _expert_problems(shape: ModelShape, layout: Layout, gpus: int) -> list[str]:
    ep, et = layout.ep, layout.expert_tp
    if not shape.experts:
        return [f"expert_model_parallel_size={ep} needs a mixture-of-experts model"] if ep > 1 else []
    out = []
    if shape.experts % ep:
        out.append(f"model.num_moe_experts={shape.experts} is not divisible by expert_model_parallel_size={ep}")
    if shape.expert_ffn % et:
        out.append(f"the expert width {shape.expert_ffn} is not divisible by expert_tensor_parallel_size={et}")
    per_stage = gpus // layout.pp
    if per_stage % (ep * et):
        out.append(f"expert_model_parallel_size={ep} x expert_tensor_parallel_size={et} does not divide the "
                   f"{per_stage} GPUs of a pipeline stage")
    if layout.tp > 1 and not layout.sequence_parallel:
        out.append("a mixture-of-experts model at tensor_model_parallel_size > 1 needs sequence_parallel")
    return out


def _recompute(cfg: Any, opts: PlanOptions) -> str:
    value = opts.recompute or getattr(cfg.parallel, "recompute_granularity", None) or "none"
    if value not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {value!r}")
    return value


def _with_vocab(cfg: Any) -> Any:
    """``model.vocab_size`` left out is the tokenizer's, as in the trainer."""
    if cfg.model.vocab_size is not None:
        return cfg
    from ..data.tokenizer import resolve_vocab_size

    return resolve_vocab_size(cfg)


def plan_layout(cfg: Any, opts: PlanOptions = PlanOptions()) -> Plan:
    """Check and estimate the config's layout, with the options' overrides."""
    cfg = _with_vocab(cfg)
    par = cfg.parallel
    t = opts.tp or par.tensor_model_parallel_size
    p = opts.pp or par.pipeline_model_parallel_size
    v = par.virtual_pipeline_model_parallel_size if opts.vpp is None else (opts.vpp or None)
    # The config's sequence parallelism follows TP down to 1 (it needs TP > 1); only an explicit
    # --sequence-parallel on with TP 1 is a problem.
    sp = par.sequence_parallel and t > 1 if opts.sequence_parallel is None else opts.sequence_parallel
    return _plan(cfg, opts, t, p, v, sp, par.use_distributed_optimizer, _recompute(cfg, opts))


def _plan(cfg: Any, opts: PlanOptions, t: int, p: int, v: Optional[int], sp: bool, dist_opt: bool,
          recompute: str) -> Plan:
    for name, value in (("TP", t), ("PP", p), ("CP", opts.cp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    gpus = opts.gpus or t * p * opts.cp
    dp = max(1, gpus // (t * p * opts.cp))
    par = cfg.parallel
    layout = Layout(tp=t, pp=p, vpp=v, cp=opts.cp, dp=dp, sequence_parallel=sp, distributed_optimizer=dist_opt,
                    ep=opts.ep or getattr(par, "expert_model_parallel_size", 1),
                    etp=getattr(par, "expert_tensor_parallel_size", None))
    micro = opts.micro_batch or cfg.train.micro_batch_size
    problems = layout_problems(cfg, layout, gpus, micro)
    seq = training_seq_len(cfg)
    r = cfg.rollout
    samples_per_dp = r.prompts_per_iteration * r.group_size // dp
    work = Workload(
        seq_len=seq, micro_batch=micro, num_microbatches=max(1, -(-cfg.train.mini_batch_size // (dp * micro))),
        recompute=recompute, params_dtype=cfg.precision.params_dtype, fp8=cfg.precision.fp8 is not None,
        flash_attention=cfg.precision.transformer_engine, attention_dropout=cfg.model.attention_dropout > 0,
        hidden_dropout=cfg.model.hidden_dropout > 0, optimizer=cfg.optim.name, logits_chunk=opts.logits_chunk,
        ref_model=cfg.loss.ref_kl_coef > 0, ref_offload=cfg.loss.ref_offload, rollout_batch=max(1, min(r.batch_size, samples_per_dp)),
        rollout_len=seq, rollout_prompt_len=min(cfg.data.max_prompt_len, seq), samples_per_dp_rank=samples_per_dp, reserve_gib=opts.reserve_gib,
        **engine_workload(cfg, t * p, opts.hardware.gpu_mem_gib))
    shape = model_shape(cfg.model)
    problems += vllm_engine_problems(shape, layout, work)
    stages = estimate(shape, layout, work)
    samples = r.prompts_per_iteration * r.group_size
    time = iteration_time(shape, layout, work, opts.hardware, samples=samples,
                          mini_batch=work.num_microbatches * micro * dp, inner_epochs=cfg.train.inner_epochs)
    return Plan(layout, work, shape, stages, problems, opts.hardware.gpu_mem_gib, time, samples)


def engine_workload(cfg: Any, mp: int, gpu_mem_gib: float) -> dict:
    """The rollout engine's part of the workload: rollout.engine=vllm puts a vLLM worker of
    rollout.vllm.tensor_parallel_size (default the replica's TP x PP) on the trainer's GPUs."""
    if cfg.rollout.engine != "vllm":
        return {}
    v = cfg.rollout.vllm
    return dict(engine_workers=v.tensor_parallel_size or mp, engine_gpu_bytes=v.gpu_memory_utilization * gpu_mem_gib * GIB,
                engine_sleep_level=v.sleep_level, refit_bucket_bytes=v.refit_bucket_mb * 2**20)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_layouts(cfg: Any, opts: PlanOptions) -> list[Plan]:
    """Every valid layout for ``opts.gpus`` GPUs, feasible ones first, ranked by modelled throughput.

    TP ranges over divisors of the GPU count that shard heads, K/V groups and the MLP; PP over
    divisors of the layer count; VPP over the chunkings that divide the layers; recompute over
    none/selective/full unless fixed. Sequence parallelism is on whenever TP > 1 and the
    distributed optimizer always (both only save memory at equal communication volume).
    """
    cfg = _with_vocab(cfg)
    if not opts.gpus:
        raise ValueError("--search needs --gpus")
    shape = model_shape(cfg.model)
    recomputes = [opts.recompute] if opts.recompute else list(RECOMPUTE)
    tps = [opts.tp] if opts.tp else [t for t in _divisors(opts.gpus)
                                     if shape.heads % t == 0 and shape.kv_groups % t == 0 and shape.ffn % t == 0]
    plans = []
    for t in tps:
        pps = [opts.pp] if opts.pp else _divisors(shape.num_layers)
        for p in pps:
            if opts.gpus % (t * p * opts.cp):
                continue
            vpps: list[Optional[int]] = [None]
            if opts.vpp is not None:
                vpps = [opts.vpp or None]
            elif p > 1:
                vpps += [v for v in _divisors(shape.num_layers // p) if v > 1]
            for v in vpps:
                for rc in recomputes:
                    plan = _plan(cfg, opts, t, p, v, t > 1, True, rc)
                    if not plan.problems:
                        plans.append(plan)
    plans.sort(key=lambda x: (not x.fits, -x.tokens_per_s_per_gpu if x.fits else x.peak_gib, x.peak_gib))
    return plans


def format_plan(plan: Plan, title: str = "") -> str:
    """Human-readable report: model, layout, workload, every memory term per stage, the step model."""
    L, w, m = plan.layout, plan.work, plan.model
    lines = []
    if title:
        lines.append(title)
    lines.append(f"model     {m.total_params(L.tp) / 1e9:.2f}B params: {m.num_layers} layers, hidden {m.hidden}, "
                 f"ffn {m.ffn}{' (SwiGLU)' if m.swiglu else ''}, heads {m.heads}/{m.kv_groups} KV, "
                 f"vocab {m.vocab} (padded {m.padded_vocab(L.tp)} at TP={L.tp})"
                 + (f"; MoE: {m.experts} experts of width {m.expert_ffn}, top-{m.topk}, "
                    f"{(m.total_params(L.tp) - m.num_layers * (m.expert_params_per_layer() - m.topk * m.one_expert_params())) / 1e9:.2f}B active"
                    if m.experts else ""))
    lines.append(f"layout    {L.gpus} GPUs = TP{L.tp} x PP{L.pp}{f' (VPP{L.vpp})' if L.vpp else ''} x CP{L.cp} "
                 f"x DP{L.dp}; sequence parallel {'on' if L.sequence_parallel else 'off'}, "
                 f"distributed optimizer {'on' if L.distributed_optimizer else 'off'}"
                 + (f"; experts EP{L.ep} x expert-TP{L.expert_tp} (expert DP {L.expert_dp:g})" if m.experts else ""))
    lines.append(f"workload  sequence {w.seq_len}, micro-batch {w.micro_batch}, {w.num_microbatches} micro-batches "
                 f"per step per DP rank, recompute {w.recompute}, {w.params_dtype}{' + FP8' if w.fp8 else ''}, "
                 f"{'fused (TE) attention' if w.flash_attention else 'unfused attention (s x s scores stored)'}; "
                 f"rollout {w.rollout_batch} sequences x {w.rollout_len} tokens per DP rank")
    for st in plan.stages:
        where = "first" if st.stage == 0 else "last"
        if plan.layout.pp == 1:
            where = "only"
        lines.append(f"stage {st.stage} ({where}): peak {st.peak / GIB:.2f} GiB in the {st.peak_phase} phase")
        for term in st.terms:
            lines.append(f"  {term.phase:<8}{term.name:<27}{term.gib:8.2f} GiB  {term.why}")
    it, s = plan.time, plan.time.step
    lines.append(f"step      ~{s.total_s:.2f} s per optimizer step: compute {s.compute_s:.2f} s, TP comm "
                 f"{s.tp_comm_s:.2f} s, PP p2p {s.pp_comm_s:.3f} s, DP comm {s.dp_comm_s:.2f} s, "
                 f"bubble {100 * s.bubble:.1f}%")
    engine = (f"vLLM TP{w.engine_workers} engine, refit not counted" if w.engine_workers
              else "Megatron engine")  # the roofline of docs/launch.md at the engine's own layout
    lines.append(f"iteration ~{it.total_s:.0f} s for {plan.samples} samples: rollout {it.rollout_s:.0f} s "
                 f"({engine}), old log-probs "
                 f"{it.logprob_s:.0f} s, {it.steps} optimizer steps {it.train_s:.0f} s -> "
                 f"~{plan.tokens_per_s_per_gpu:.0f} tokens/s/GPU (rough model, see docs/launch.md)")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(f"verdict   {verdict}: peak {plan.peak_gib:.2f} GiB of {plan.gpu_mem_gib:g} GiB per GPU")
    lines += [f"  - {r}" for r in plan.reasons()]
    return "\n".join(lines)
