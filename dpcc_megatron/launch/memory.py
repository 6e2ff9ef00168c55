"""Per-GPU memory of a DPCC job under a Megatron layout, one explained term at a time.

Pure arithmetic on plain dataclasses (no torch, no Megatron, no config import), in bytes.

**Weights, grads, optimizer.** Megatron's distributed-optimizer table gives bytes per
parameter (d = data-parallel size): bf16 params with fp32 grads 18, or 6 + 12/d with the
distributed optimizer; fp32 params 16, or 8 + 8/d. This project always accumulates and
reduces grads in fp32 (``grad_reduce_in_fp32``), so fp16 follows the bf16 row. The
optimizer state is the fp32 main copy (mixed precision only) plus Adam's m and v.

**Activations.** Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Table 2: one layer stores ``s*b*h*(34 + 5*a*s/h)`` bytes; with
tensor parallelism ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``; with sequence parallelism
everything is divided by t; selective recompute drops the ``5*a*s/h`` attention-score
term; full recompute keeps only the layer input (``2*s*b*h``). :func:`layer_activation_bytes`
counts the same tensors term by term, so it also covers GQA (K/V of ``g*d`` columns), SwiGLU
(the MLP's first output is ``2*f`` wide), flash attention (no ``s x s`` scores, one fp32
log-sum-exp per head and token), no dropout (no masks) and FP8 (linear inputs kept in one
byte). With ``a = g``, ``f = 4h``, GELU, dropout and no flash attention it is exactly 34.

**Mixture of experts.** An MoE layer replaces the dense MLP by a router (``E x h``, replicated)
and E experts of width ``f_e``; each rank holds ``E / EP`` experts split over expert-TP, so expert
weights, their fp32 grads and their optimizer state (sharded over the expert data-parallel group,
``TP x DP x CP / (EP x ETP)``) are terms of their own. Activations assume balanced routing: each
GPU's experts see ``k`` routed copies of its (sequence-parallel) tokens, times ETP (tokens are
gathered over expert-TP), and the dispatcher keeps a permuted copy for the combine. The
all-to-all send and receive buffers of one layer are a transient train-phase term. A hot expert
receives more than its share: these are estimates for balanced routing.

**Pipeline.** Under 1F1B, stage i holds ``min(p - i, m)`` micro-batches in flight; with v
interleaved chunks it holds ``min(2*(p-i-1) + (v-1)*p + 1, m*v)`` chunk-micro-batches, so the
first stage holds L layers' worth, times ``1 + (p-1)/(p*v)`` when interleaved (the paper's
interleaving penalty).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GIB = float(1 << 30)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers that decide memory."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    head_dim: int
    vocab: int
    vocab_divisor: int = 128
    swiglu: bool = True
    tied_embeddings: bool = False
    layernorm: bool = False
    """LayerNorm (weight and bias) instead of RMSNorm (weight only)."""
    qkv_bias: bool = False
    linear_bias: bool = False
    learned_positions: int = 0
    """Rows of a learned absolute position table (0 with RoPE)."""
    experts: int = 0
    """Routed experts per layer (0: a dense MLP)."""
    topk: int = 0
    """Experts each token is routed to."""
    expert_ffn: int = 0
    """Each expert's MLP width."""
    qk_norm: bool = False
    """Per-head query and key norms (Qwen3)."""

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of ``vocab_divisor * tp``."""
        m = self.vocab_divisor * tp
        return -(-self.vocab // m) * m

    def dense_linear_params_per_layer(self) -> int:
        """The layer's TP-split linear weights: attention, and the MLP unless it is an MoE layer."""
        q, kv = self.heads * self.head_dim, self.kv_groups * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        mlp = 0 if self.experts else self.hidden * self.ffn * (3 if self.swiglu else 2)
        bias = (q + 2 * kv) if (self.qkv_bias or self.linear_bias) else 0
        if self.linear_bias:  # out-proj, fc1 (gate and up), fc2
            bias += 2 * self.hidden + self.ffn * (2 if self.swiglu else 1)
        return attn + mlp + bias

    def one_expert_params(self) -> int:
        return self.hidden * self.expert_ffn * (3 if self.swiglu else 2)

    def expert_params_per_layer(self) -> int:
        """Every expert of one MoE layer (0 for a dense model)."""
        return self.experts * self.one_expert_params()

    def router_params(self) -> int:
        return self.experts * self.hidden

    def linear_params_per_layer(self) -> int:
        """Linear weights one token passes through in a layer (the FLOP count): with MoE, the router
        and its top-k experts only."""
        return self.dense_linear_params_per_layer() + self.router_params() + self.topk * self.one_expert_params()

    def norm_params(self) -> int:
        return self.hidden * (2 if self.layernorm else 1)

    def small_params_per_layer(self) -> int:
        """Replicated over TP: the two norms, QK norms, the router."""
        return 2 * self.norm_params() + (2 * self.head_dim if self.qk_norm else 0) + self.router_params()

    def layer_params(self) -> int:
        return self.dense_linear_params_per_layer() + self.expert_params_per_layer() + self.small_params_per_layer()

    def total_params(self, tp: int = 1) -> int:
        emb = self.padded_vocab(tp) * self.hidden
        out = 0 if self.tied_embeddings else emb
        return (self.num_layers * self.layer_params() + self.norm_params() + emb + out
                + self.learned_positions * self.hidden)


@dataclass(frozen=True)
class Layout:
    """Parallel layout; DP is what the GPUs leave over."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    ep: int = 1
    """Expert parallelism: experts split over EP ranks carved from TP x DP x CP."""
    etp: Optional[int] = None
    """Tensor parallelism inside each expert; None: TP."""

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> float:
        """Ranks holding the same expert shard: TP x DP x CP / (EP x ETP)."""
        return self.tp * self.dp * self.cp / (self.ep * self.expert_tp)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


@dataclass(frozen=True)
class Workload:
    """What one optimizer step and one rollout pass put on the GPU."""

    seq_len: int
    """Training sequence (prompt + response), tokens."""
    micro_batch: int
    num_microbatches: int
    """Micro-batches per optimizer step on one DP rank (m)."""
    recompute: str = "none"
    params_dtype: str = "bf16"
    fp8: bool = False
    flash_attention: bool = True
    """Fused attention (Transformer Engine): no s x s score tensors are stored."""
    attention_dropout: bool = False
    hidden_dropout: bool = False
    optimizer: str = "adam"
    logits_chunk: int = 1024
    """Tokens per fp32 chunk of the vocab-parallel log-prob op."""
    ref_model: bool = False
    """A reference policy exists (loss.ref_kl_coef > 0): its weights and logits count."""
    ref_offload: bool = False
    """loss.ref_offload: the reference weights live in host memory between its forwards, so they are
    not resident during the update (the planner leaves them out of the training peak)."""
    rollout_batch: int = 0
    """Sequences generated together per DP rank (KV-cache batch); 0: no rollout on this GPU."""
    rollout_len: int = 0
    """Prompt + generated tokens (the KV cache's length)."""
    rollout_prompt_len: int = 0
    """Prompt tokens run through one prefill forward."""
    samples_per_dp_rank: int = 0
    """Rollout samples held per iteration on one DP rank (tokens, masks, old/ref log-probs)."""
    reserve_gib: float = 4.0
    """CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation."""
    engine_workers: int = 0
    """rollout.engine=vllm: the vLLM engine's tensor-parallel size W (0: the Megatron engine decodes)."""
    engine_gpu_bytes: float = 0.0
    """rollout.vllm.gpu_memory_utilization x GPU memory: what vLLM takes on a worker's GPU while awake."""
    engine_sleep_level: int = 1
    """rollout.vllm.sleep_level: 0 keeps the engine resident through training."""
    refit_bucket_bytes: float = 0.0
    """rollout.vllm.refit_bucket_mb in bytes."""

    @property
    def act_bytes(self) -> int:
        return 4 if self.params_dtype == "fp32" else 2


@dataclass(frozen=True)
class Term:
    name: str
    phase: str
    """static (always resident) | train | rollout."""
    bytes: float
    why: str

    @property
    def gib(self) -> float:
        return self.bytes / GIB


# -- parameters ------------------------------------------------------------------------------------

def layers_on_stage(model: ModelShape, layout: Layout) -> int:
    """Transformer layers one pipeline stage holds (ceil when they do not divide; the layout check rejects that)."""
    per_chunk = -(-model.num_layers // (layout.pp * layout.chunks))
    return per_chunk * layout.chunks


def stage_params(model: ModelShape, layout: Layout, stage: int) -> float:
    """Parameters held by one GPU of pipeline stage ``stage`` (linear weights split over TP)."""
    t = layout.tp
    n = layers_on_stage(model, layout) * (model.dense_linear_params_per_layer() / t + model.small_params_per_layer())
    emb = model.padded_vocab(t) * model.hidden / t
    if stage == 0:
        n += emb + model.learned_positions * model.hidden
    if stage == layout.pp - 1:
        n += model.norm_params()
        # Untied: the output layer. Tied with PP > 1: the last stage keeps its own copy.
        if not model.tied_embeddings or layout.pp > 1:
            n += emb
    return n


def stage_expert_params(model: ModelShape, layout: Layout) -> float:
    """Expert parameters on one GPU: its E / EP experts of each layer on the stage, split over expert-TP."""
    return layers_on_stage(model, layout) * model.expert_params_per_layer() / (layout.ep * layout.expert_tp)


def bytes_per_param(work: Workload, layout: Layout) -> tuple[float, float, float]:
    """(weights, grads, optimizer state) bytes per parameter on one GPU."""
    mixed = work.params_dtype in ("bf16", "fp16")
    weight = 2 if mixed else 4
    grad = 4  # fp32 main grads (grad_reduce_in_fp32) whatever the parameter dtype
    state = (4 if mixed else 0) + (8 if work.optimizer == "adam" else 4)
    if layout.distributed_optimizer:
        state /= layout.dp * layout.cp  # sharded over the DP x CP group
    return weight, grad, state


def expert_routed_tokens(model: ModelShape, layout: Layout, work: Workload) -> float:
    """(token, expert) pairs one GPU's experts process per layer and micro-batch, balanced routing:
    its (sequence-parallel) tokens x top-k, gathered over expert-TP."""
    local = work.seq_len / layout.cp * work.micro_batch / (layout.tp if layout.sequence_parallel else 1)
    return local * model.topk * layout.expert_tp


# -- activations -----------------------------------------------------------------------------------

def layer_activation_bytes(model: ModelShape, layout: Layout, work: Workload, *, seq: Optional[int] = None,
                           micro: Optional[int] = None, recompute: Optional[str] = None,
                           sequence_parallel: Optional[bool] = None, cp: Optional[int] = None) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch on one GPU."""
    recompute = work.recompute if recompute is None else recompute
    sp = layout.sequence_parallel if sequence_parallel is None else sequence_parallel
    cp = layout.cp if cp is None else cp
    s = (work.seq_len if seq is None else seq) / cp
    b = work.micro_batch if micro is None else micro
    h, t, a = model.hidden, layout.tp, model.heads
    e = work.act_bytes
    lin = 1 if work.fp8 else e           # what a linear layer saves of its input
    sbh = s * b * h
    if recompute == "full":
        # Only the layer input is kept; the rest is recomputed one layer at a time.
        return e * sbh / (t if sp else 1)
    q, kv = a * model.head_dim * s * b, model.kv_groups * model.head_dim * s * b
    # Outside the TP region (split over t only with SP): both norm inputs, the QKV and
    # fc1 inputs (the norm outputs), the two residual dropout masks.
    outside = e * sbh + lin * sbh + e * sbh + lin * sbh + (2 * sbh if work.hidden_dropout else 0)
    # Inside the TP region (always split over t): Q, K, V, attention output (out-proj input),
    # the MLP's first output (activation input) and the activation output (fc2 input).
    inside = e * (q + 2 * kv) + lin * q
    if model.experts:
        # Router logits and scores (fp32) per local token; per routed copy: the expert input, its fc1
        # output and activation output (split over expert-TP), and the permuted copy for the combine.
        r = s * b / (t if sp else 1) * model.topk * layout.expert_tp  # see expert_routed_tokens
        fe, et = model.expert_ffn, layout.expert_tp
        experts = 2 * 4 * model.experts * sbh / h / (t if sp else 1)
        experts += r * (lin * h + e * h + (e * fe * (2 if model.swiglu else 1) + lin * fe) / et)
    else:
        inside += e * s * b * model.ffn * (2 if model.swiglu else 1) + lin * s * b * model.ffn
    if work.flash_attention:
        inside += 4 * a * s * b  # fp32 log-sum-exp per head and token
    elif recompute != "selective":
        # softmax output (2), dropout mask (1) and dropout output (2) per score
        score = a * s * s * b * cp  # a context-parallel rank attends its s queries to all keys
        inside += score * (2 + (3 if work.attention_dropout else 0))
    return outside / (t if sp else 1) + inside / t + (experts if model.experts else 0.0)


def in_flight(stage: int, layout: Layout, num_microbatches: int) -> int:
    """Micro-batch chunks whose activations stage ``stage`` holds at its peak (1F1B / interleaved)."""
    p, v, m = layout.pp, layout.chunks, num_microbatches
    if p == 1:
        return 1
    if v == 1:
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


# -- the terms -------------------------------------------------------------------------------------

def stage_terms(model: ModelShape, layout: Layout, work: Workload, stage: int) -> list[Term]:
    """Every term on one GPU of pipeline stage ``stage``."""
    t, p = layout.tp, layout.pp
    params = stage_params(model, layout, stage)
    w, g, o = bytes_per_param(work, layout)
    d_opt = layout.dp * layout.cp
    terms = [
        Term("weights", "static", params * w,
             f"{params / 1e9:.3f}B params on this GPU x {w:g} B ({work.params_dtype})"),
        Term("grads", "static", params * g, f"fp32 main-grad buffer, {g:g} B/param"),
        Term("optimizer", "static", params * o,
             ("fp32 main params + Adam m, v" if work.params_dtype != "fp32" else "Adam m, v")
             + (f", sharded over DPxCP={d_opt} (distributed optimizer)" if layout.distributed_optimizer
                else ", replicated on every DP rank (distributed optimizer off)")),
    ]
    if model.experts:
        ep_params = stage_expert_params(model, layout)
        ep_state = o * (layout.dp * layout.cp / layout.expert_dp if layout.distributed_optimizer else 1)
        terms += [
            Term("expert weights", "static", ep_params * w,
                 f"{ep_params / 1e9:.3f}B expert params on this GPU: {model.experts}/EP={layout.ep} experts x "
                 f"{layers_on_stage(model, layout)} layers / expert-TP={layout.expert_tp}, x {w:g} B"),
            Term("expert grads", "static", ep_params * g, f"fp32 main-grad buffer of the experts, {g:g} B/param"),
            Term("expert optimizer", "static", ep_params * ep_state,
                 "fp32 main params + Adam m, v of the experts"
                 + (f", sharded over the expert data-parallel group of {layout.expert_dp:g}"
                    if layout.distributed_optimizer else ", not sharded (distributed optimizer off)")),
        ]
    if work.fp8:
        lin = layers_on_stage(model, layout) * model.dense_linear_params_per_layer() / t
        terms.append(Term("fp8 weight copies", "static", 2 * lin,
                          "Transformer Engine caches an FP8 weight and its transpose per linear layer"))
    if work.ref_model and not work.ref_offload:
        terms.append(Term("reference weights", "static", params * w,
                          "reference policy (loss.ref_kl_coef > 0) resident in the training dtype"))
    if work.samples_per_dp_rank:
        terms.append(Term("iteration buffers", "static", work.samples_per_dp_rank * work.seq_len * (8 + 1 + 4 + 4 * 3),
                          f"{work.samples_per_dp_rank} samples/DP rank: tokens, mask, advantages, "
                          "old/ref/sampler log-probs"))
    terms.append(Term("reserve", "static", work.reserve_gib * GIB,
                      "CUDA context, NCCL/cuBLAS workspaces, fragmentation (--reserve-gib)"))

    # Training activations.
    chunks = in_flight(stage, layout, work.num_microbatches)
    per_chunk_layers = layers_on_stage(model, layout) // layout.chunks
    per_layer = layer_activation_bytes(model, layout, work)
    act = chunks * per_chunk_layers * per_layer
    why = (f"{chunks} micro-batch chunk(s) in flight x {per_chunk_layers} layer(s) x "
           f"{per_layer / 2**20:.0f} MiB (s={work.seq_len}, b={work.micro_batch}, recompute={work.recompute})")
    if work.recompute == "full":
        act += layer_activation_bytes(model, layout, work, recompute="none")
        why += " + one layer rematerialised"
    s_local = work.seq_len / layout.cp
    sb = s_local * work.micro_batch
    if stage == 0:
        mbs = in_flight(0, layout, work.num_microbatches)
        act += mbs * sb * (8 + (model.hidden / (t if layout.sequence_parallel else 1)
                                if work.hidden_dropout else 0))
    terms.append(Term("activations", "train", act, why))
    if model.experts:
        r = expert_routed_tokens(model, layout, work)
        terms.append(Term("all-to-all buffers", "train", 2 * r * model.hidden * work.act_bytes,
                          f"one MoE layer's token dispatch: send and receive buffers of {r:.0f} routed tokens x "
                          f"hidden {model.hidden} (balanced routing; EP={layout.ep})"))

    if stage == p - 1:
        vloc = model.padded_vocab(t) / t
        e = work.act_bytes
        copies = 2 + work.ref_model  # logits, their gradient, the reference logits
        chunk = min(work.logits_chunk, sb)
        buf = copies * sb * vloc * e + (4 if work.ref_model else 3) * chunk * vloc * 4 + 8 * sb * 4
        buf += 2 * e * sb * model.hidden / (t if layout.sequence_parallel else 1)  # final norm, output-layer input
        terms.append(Term("logits + log-prob buffers", "train", buf,
                          f"[{sb:.0f} tokens x {vloc:.0f} vocab/TP] logits and grad"
                          + (" + ref logits" if work.ref_model else "")
                          + f", fp32 chunks of {chunk:.0f} tokens (vocab-parallel, never gathered)"))

    if work.engine_workers:
        terms += vllm_engine_terms(model, layout, work)
    elif work.rollout_batch and work.rollout_len:
        kv = (2 * layers_on_stage(model, layout) * (model.kv_groups / t) * model.head_dim
              * work.rollout_len * work.rollout_batch * work.act_bytes)
        terms.append(Term("rollout KV cache", "rollout", kv,
                          f"K and V: {layers_on_stage(model, layout)} layers x {model.kv_groups}/{t} groups x "
                          f"{model.head_dim} x {work.rollout_len} tokens x {work.rollout_batch} sequences"))
        # A no-grad prefill frees each tensor once the next exists: one layer's tensors bound it.
        prefill = layer_activation_bytes(model, layout, work, seq=work.rollout_prompt_len or work.rollout_len,
                                         micro=work.rollout_batch, recompute="none", sequence_parallel=False, cp=1)
        sample = work.rollout_batch * model.padded_vocab(t) * 4 if stage == p - 1 else 0
        terms.append(Term("rollout working set", "rollout", prefill + sample,
                          f"upper bound of one layer's prefill tensors ({work.rollout_batch} x "
                          f"{work.rollout_prompt_len or work.rollout_len} prompt tokens)"
                          + (" + fp32 logits of the last position" if sample else "")))
    return terms


def vllm_engine_terms(model: ModelShape, layout: Layout, work: Workload) -> list[Term]:
    """A vLLM worker's GPU (rollout.engine=vllm): vLLM takes ``engine_gpu_bytes`` while awake (its weight
    share, 1/W of the model in the training dtype, plus a KV cache in the rest); asleep (sleep_level >= 1)
    it holds nothing on the GPU, so it counts in the rollout phase only. The refit adds one bucket and one
    gathered unit (its TP parts and HF copies) on the GPU. Workers sit on the first W ranks of each
    model-parallel group; the estimate is for a GPU that hosts one."""
    w = work.engine_workers
    weights = model.total_params(1) * work.act_bytes / w
    phase = "rollout" if work.engine_sleep_level >= 1 else "static"
    sleep = {0: "never sleeps: resident through training", 1: "asleep in training (weights offloaded to host "
             "memory, KV cache dropped)", 2: "asleep in training (weights and KV cache dropped)"}[work.engine_sleep_level]
    kv_room = work.engine_gpu_bytes - weights
    groups = max(model.kv_groups / w, 1)  # vLLM replicates K/V heads when W exceeds the groups
    per_seq = 2 * model.num_layers * groups * model.head_dim * work.rollout_len * work.act_bytes
    seqs = int(kv_room // per_seq) if per_seq and kv_room > 0 else 0
    bucket, unit = refit_bucket_bytes(model, work), refit_unit_params(model) * work.act_bytes
    experts = (f" (a layer's {model.experts} experts, "
               f"{model.expert_params_per_layer() * work.act_bytes / GIB:.2f} GiB, are one bucket)"
               if bucket > work.refit_bucket_bytes else "")
    return [
        Term("vLLM engine (weights + KV)", phase, work.engine_gpu_bytes,
             f"gpu_memory_utilization share: weights {weights / GIB:.1f} GiB (1/{w} of the model) + KV cache "
             f"{max(kv_room, 0) / GIB:.1f} GiB (~{seqs} sequences of {work.rollout_len} tokens); {sleep}"),
        Term("refit buffers", "rollout", bucket + 2 * unit,
             f"one {bucket / 2**20:.0f} MiB bucket{experts} + one gathered "
             f"{'layer or expert' if model.experts else 'layer'} (parts and HF copies)"),
    ]


def refit_bucket_bytes(model: ModelShape, work: Workload) -> float:
    """The refit's bucket: rollout.vllm.refit_bucket_mb, or one layer's experts in the serving dtype when that
    is larger (vLLM loads a layer's experts as one module, so they always travel in one bucket)."""
    return max(work.refit_bucket_bytes, model.expert_params_per_layer() * work.act_bytes)


def refit_unit_params(model: ModelShape) -> int:
    """Parameters of the largest unit the refit gathers at once: a layer's dense part (attention, the MLP or
    the router), or one expert."""
    return max(model.dense_linear_params_per_layer() + (model.router_params() if model.experts else 0),
               model.one_expert_params() if model.experts else 0)


def vllm_engine_problems(model: ModelShape, layout: Layout, work: Workload) -> list[str]:
    """Why the vLLM layout cannot serve the model (naming the keys), empty when it can."""
    if not work.engine_workers:
        return []
    w = work.engine_workers
    weights = model.total_params(1) * work.act_bytes / w
    out = []
    mp = layout.tp * layout.pp
    if mp % w or model.heads % w or (model.kv_groups % w and w % model.kv_groups):
        out.append(f"rollout.vllm.tensor_parallel_size={w} must divide TP x PP = {mp} and the {model.heads} attention "
                   f"heads, and divide or be a multiple of the {model.kv_groups} query groups")
    if weights >= work.engine_gpu_bytes:
        out.append(f"rollout.vllm.tensor_parallel_size={w}: each vLLM worker would hold {weights / GIB:.1f} GiB of "
                   f"weights (1/{w} of the model), more than its rollout.vllm.gpu_memory_utilization share "
                   f"({work.engine_gpu_bytes / GIB:.1f} GiB), leaving no KV cache; raise the size or the share")
    return out


@dataclass(frozen=True)
class StageMemory:
    stage: int
    terms: tuple[Term, ...]

    def phase(self, name: str) -> float:
        return sum(x.bytes for x in self.terms if x.phase == name)

    @property
    def peak(self) -> float:
        """Resident state plus the larger of the training and rollout phases (they never overlap)."""
        return self.phase("static") + max(self.phase("train"), self.phase("rollout"))

    @property
    def peak_phase(self) -> str:
        return "train" if self.phase("train") >= self.phase("rollout") else "rollout"


def estimate(model: ModelShape, layout: Layout, work: Workload) -> list[StageMemory]:
    """Memory of the first and the last pipeline stage (the two extremes); one entry when PP = 1."""
    stages = sorted({0, layout.pp - 1})
    return [StageMemory(s, tuple(stage_terms(model, layout, work, s))) for s in stages]


def peak_stage(stages: list[StageMemory]) -> StageMemory:
    return max(stages, key=lambda s: s.peak)


def bubble_fraction(layout: Layout, num_microbatches: int) -> float:
    """Idle share of a pipeline step: (p - 1) / (m * v + p - 1)."""
    p = layout.pp
    return (p - 1) / (num_microbatches * layout.chunks + p - 1)


__all__ = ["GIB", "RECOMPUTE", "Layout", "ModelShape", "StageMemory", "Term", "Workload", "bubble_fraction",
           "bytes_per_param", "estimate", "expert_routed_tokens", "in_flight", "layer_activation_bytes", "layers_on_stage",
           "peak_stage", "refit_bucket_bytes", "refit_unit_params", "stage_expert_params", "stage_params", "stage_terms",
           "vllm_engine_problems", "vllm_engine_terms"]
