"""A simple, documented time model used to rank layouts: one RL iteration on the training layout.

    iteration = rollout + old-log-prob forward + K * (samples / mini_batch) optimizer steps

**Optimizer step** ``(compute + TP comm + PP p2p) / (1 - bubble) + DP comm``:

* compute: model FLOPs (3x the forward; full recompute adds a forward of every layer,
  selective the attention scores) over ``gpus * peak_tflops * mfu_ceiling``;
* TP comm: per layer and micro-batch, four all-gather/reduce-scatter (or all-reduce) pairs
  move ``8 (t-1)/t`` times the ``s*b*h`` activation, over NVLink while TP fits in a node and
  over the network otherwise (~9x slower at the defaults); not overlapped;
* PP p2p: each micro-batch chunk sends its activation forward and its gradient back;
* bubble: ``(p - 1) / (m*v + p - 1)`` of the pipeline's time is idle;
* DP comm: grad reduce-scatter (fp32) + param all-gather (distributed optimizer) or an fp32
  all-reduce of ``(d-1)/d`` of the local parameters; exposed, as this project's DDP does not
  overlap it (``overlap_grad_reduce=False``).

**Rollout** (generation with the policy itself, :mod:`dpcc_megatron.megatron.generate`):
each DP rank decodes its samples in batches of ``rollout.batch_size``. One decode step reads
the whole model's weights (``1/t`` of them per GPU: the pipeline stages run one after the
other, generation is not pipelined) and the KV cache from HBM, or is bound by its FLOPs,
whichever is slower, plus two TP collectives per layer and one p2p hop per stage, each
costing a fixed latency. Prefill is compute bound. So PP saves memory but not rollout time,
TP shortens decode until its latency dominates, and DP divides the samples.

**Rollout with ``rollout.engine: vllm``** (``Workload.engine_workers`` = W): one vLLM engine per
replica, tensor parallel over its W workers (one per GPU, not pipelined), modelled with the same
roofline at TP = W and PP = 1: each decode step reads 1/W of the weights and of the KV cache (K/V
heads replicated once W exceeds the query groups) per GPU, plus two TP collectives per layer; the
replica's samples are decoded in batches of ``rollout.batch_size`` as with the Megatron engine.
Assumed, not measured: vLLM's continuous batching, paged attention and CUDA graphs are not
credited (so the estimate is pessimistic for vLLM), and the refit (each iteration's weights
streamed into the engine) and the sleep/wake transitions are not counted.

The absolute numbers are rough (kernel efficiency is one constant); ``plan --search`` uses
them to rank layouts.
"""
from __future__ import annotations

from dataclasses import dataclass

from .memory import Layout, ModelShape, Workload, bubble_fraction, layers_on_stage, stage_params


@dataclass(frozen=True)
class Hardware:
    gpu_mem_gib: float = 80.0
    gpus_per_node: int = 8
    peak_tflops: float = 989.0
    """Dense bf16 TFLOP/s of one GPU (H100/H200 SXM)."""
    mfu_ceiling: float = 0.6
    """Fraction of peak that large GEMMs reach."""
    hbm_gbps: float = 3350.0
    """HBM bandwidth per GPU, GB/s (H100 SXM; H200: 4800)."""
    intra_node_gbps: float = 450.0
    """NVLink bandwidth per GPU and direction, GB/s."""
    inter_node_gbps: float = 50.0
    """Network bandwidth per GPU, GB/s (one 400 Gb/s NIC per GPU)."""
    intra_latency_us: float = 10.0
    """Fixed cost of one small collective or p2p inside a node."""
    inter_latency_us: float = 30.0
    """... across nodes."""


@dataclass(frozen=True)
class StepTime:
    """One optimizer step."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble: float
    total_s: float


@dataclass(frozen=True)
class IterationTime:
    """One RL iteration: rollout, old-log-prob forward, the optimizer steps."""

    rollout_s: float
    logprob_s: float
    train_s: float
    step: StepTime
    steps: int

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.logprob_s + self.train_s


def forward_flops_per_token(model: ModelShape, seq: int) -> float:
    """Linear layers (2 FLOPs per weight) plus attention scores (QK^T and AV), counted in full."""
    linear = model.num_layers * model.linear_params_per_layer() + model.padded_vocab(1) * model.hidden
    return 2 * linear + 4 * seq * model.heads * model.head_dim * model.num_layers


def flops_per_token(model: ModelShape, seq: int, recompute: str) -> float:
    """Training FLOPs per token: 3x the forward, plus what recompute runs again."""
    scores = 4 * seq * model.heads * model.head_dim * model.num_layers
    extra = {"none": 0.0, "selective": scores,
             "full": 2 * model.num_layers * model.linear_params_per_layer() + scores}[recompute]
    return 3 * forward_flops_per_token(model, seq) + extra


def _bw(hw: Hardware, intra: bool) -> float:
    return (hw.intra_node_gbps if intra else hw.inter_node_gbps) * 1e9


def _lat(hw: Hardware, intra: bool) -> float:
    return (hw.intra_latency_us if intra else hw.inter_latency_us) * 1e-6


def _pp_intra(layout: Layout, hw: Hardware) -> bool:
    # Megatron orders ranks TP fastest, then CP, DP, PP: neighbouring stages are tp*cp*dp apart.
    return layout.tp * layout.cp * layout.dp < hw.gpus_per_node


def step_time(model: ModelShape, layout: Layout, work: Workload, hw: Hardware, global_batch: int) -> StepTime:
    """Time of one optimizer step over ``global_batch`` sequences of ``work.seq_len`` tokens."""
    tokens = global_batch * work.seq_len
    compute = tokens * flops_per_token(model, work.seq_len, work.recompute) / (
        layout.gpus * hw.peak_tflops * 1e12 * hw.mfu_ceiling)
    e = work.act_bytes
    t, m, v = layout.tp, work.num_microbatches, layout.chunks
    sbh = work.seq_len / layout.cp * work.micro_batch * model.hidden
    tp_comm = 0.0
    if t > 1:
        per_layer = 8 * (t - 1) / t * e * sbh * (1.5 if work.recompute == "full" else 1.0)
        tp_comm = per_layer * layers_on_stage(model, layout) * m / _bw(hw, t <= hw.gpus_per_node)
    pp_comm = 0.0
    if layout.pp > 1:
        msg = e * sbh / (t if layout.sequence_parallel else 1)
        pp_comm = 2 * msg * m * v / _bw(hw, _pp_intra(layout, hw))
    d = layout.dp * layout.cp
    dp_comm = 0.0
    if d > 1:
        per_param = (4 + 2) if layout.distributed_optimizer else 2 * 4
        dp_comm = (d - 1) / d * stage_params(model, layout, 0) * per_param / _bw(
            hw, t * layout.cp * layout.dp <= hw.gpus_per_node)
    bubble = bubble_fraction(layout, m)
    total = (compute + tp_comm + pp_comm) / (1 - bubble) + dp_comm
    return StepTime(compute, tp_comm, pp_comm, dp_comm, bubble, total)


def rollout_time(model: ModelShape, layout: Layout, work: Workload, hw: Hardware) -> float:
    """Seconds for one DP rank to generate its ``samples_per_dp_rank`` responses."""
    if not (work.samples_per_dp_rank and work.rollout_batch):
        return 0.0
    t, p, e = layout.tp, layout.pp, work.act_bytes
    if work.engine_workers:  # vLLM: one tensor-parallel engine of W workers per replica (module docstring)
        t, p = work.engine_workers, 1
    batch, prompt = work.rollout_batch, work.rollout_prompt_len
    new = max(0, work.rollout_len - prompt)
    passes = -(-work.samples_per_dp_rank // batch)
    mp_gpus = t * p  # the model-parallel group that runs one generation
    weights = model.total_params(t) / t * e  # every stage in turn: 1/t of the model per step
    kv_avg = 2 * model.num_layers * max(model.kv_groups / t, 1) * model.head_dim * (prompt + new / 2) * batch * e
    flops = batch * forward_flops_per_token(model, prompt + new / 2) / t
    latency = 2 * model.num_layers * _lat(hw, t <= hw.gpus_per_node) * (t > 1) + (p - 1) * _lat(hw, _pp_intra(layout, hw))
    decode_step = max((weights + kv_avg) / (hw.hbm_gbps * 1e9), flops / (hw.peak_tflops * 1e12 * hw.mfu_ceiling))
    decode_step += latency
    prefill = batch * prompt * forward_flops_per_token(model, prompt) / (mp_gpus * hw.peak_tflops * 1e12
                                                                          * hw.mfu_ceiling) * p
    return passes * (prefill + new * decode_step)


def iteration_time(model: ModelShape, layout: Layout, work: Workload, hw: Hardware, *, samples: int,
                   mini_batch: int, inner_epochs: int) -> IterationTime:
    """One RL iteration of ``samples`` sequences, ``inner_epochs`` passes of ``mini_batch``-sample steps."""
    step = step_time(model, layout, work, hw, mini_batch)
    steps = max(1, inner_epochs * -(-samples // mini_batch))
    fwd = samples * work.seq_len * forward_flops_per_token(model, work.seq_len) / (
        layout.gpus * hw.peak_tflops * 1e12 * hw.mfu_ceiling)
    logprob = (fwd + step.tp_comm_s / 3 * samples / mini_batch) / (1 - step.bubble)
    return IterationTime(rollout_time(model, layout, work, hw), logprob, steps * step.total_s, step, steps)
