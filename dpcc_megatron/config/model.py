"""Model architecture, parallel layout and precision sections."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union, Literal, Optional

from .base import check


@dataclass
class ModelConfig:
    """GPT architecture, mapped one to one onto Megatron-Core's TransformerConfig.

    Read by: dpcc_megatron/megatron/model.py.
    """

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; None means 4*hidden_size (or the SwiGLU-adjusted size given by the checkpoint)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads for GQA; None means num_attention_heads (plain MHA)."""
    kv_channels: Optional[int] = None
    """Per-head dimension; None means hidden_size // num_attention_heads."""
    vocab_size: Optional[int] = None
    """Unpadded vocabulary size; Megatron pads it (see make_vocab_size_divisible_by). None: the
    tokenizer's size (data.tokenizer); a value below it is an error."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times TP, as Megatron does; padded rows never count."""
    max_seq_len: int = 256
    """Longest prompt+response length the model sees."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm type."""
    norm_epsilon: float = 1e-5
    """Norm epsilon (RMSNorm eps in HF configs)."""
    swiglu: bool = True
    """Gated SiLU MLP (Llama/Qwen/Mistral)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2)."""
    add_bias_linear: bool = False
    """Bias on every linear layer (GPT-2 style)."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    """Rotary or learned positions."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_scaling: Optional[dict] = None
    """HF-style rope_scaling dict (llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer."""
    init_method_std: float = 0.02
    """Std of the random initialisation (when not loading a checkpoint)."""
    attention_dropout: float = 0.0
    """Attention dropout; must be 0: pi_old is recomputed without dropout, so any dropout in the
    update would make even a first step's ratio differ from 1 (refused, not silently changed)."""
    hidden_dropout: float = 0.0
    """Hidden dropout; must be 0, as attention_dropout."""
    qk_layernorm: bool = False
    """Per-head norm (model.normalization) of queries and keys before RoPE (Qwen3)."""
    num_moe_experts: Optional[int] = None
    """Mixture of experts: routed experts per layer (every layer is an MoE layer); None: dense MLP."""
    moe_router_topk: int = 2
    """MoE: experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """MoE: each expert's MLP inner width; None means ffn_hidden_size."""
    moe_router_pre_softmax: bool = False
    """MoE: softmax over all experts, then top-k, without renormalising (Qwen3-MoE's
    norm_topk_prob: false). False: softmax over the top-k logits (Mixtral; norm_topk_prob: true)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: coefficient of the router's load-balancing loss (Switch-style, per micro-batch), added to
    the objective and reported separately as moe/load_balancing_loss; 0 disables it."""
    moe_z_loss_coeff: float = 0.0
    """MoE: coefficient of the router z-loss (mean squared logsumexp of the router logits), added to
    the objective and reported separately as moe/z_loss; 0 disables it."""
    moe_expert_capacity_factor: Optional[float] = None
    """MoE: per-expert capacity as a multiple of the even share of tokens; tokens over it are dropped
    (counted in the record). None: dropless, as the Hugging Face models are."""

    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "max_seq_len"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        check(self.vocab_size is None or self.vocab_size > 0, "vocab_size", f"must be > 0, got {self.vocab_size}")
        check(self.make_vocab_size_divisible_by > 0, "make_vocab_size_divisible_by",
              f"must be > 0, got {self.make_vocab_size_divisible_by}")
        if self.kv_channels is None:
            check(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                  f"must be divisible by num_attention_heads={self.num_attention_heads}, got {self.hidden_size}")
        groups = self.num_query_groups or self.num_attention_heads
        check(groups > 0 and self.num_attention_heads % groups == 0, "num_query_groups",
              f"must divide num_attention_heads={self.num_attention_heads}, got {self.num_query_groups}")
        check(self.norm_epsilon > 0, "norm_epsilon", f"must be > 0, got {self.norm_epsilon}")
        if self.num_moe_experts is not None:
            check(self.num_moe_experts >= 2, "num_moe_experts", f"must be >= 2 (or null for a dense MLP), got "
                  f"{self.num_moe_experts}")
            check(1 <= self.moe_router_topk <= self.num_moe_experts, "moe_router_topk",
                  f"must be in [1, num_moe_experts={self.num_moe_experts}], got {self.moe_router_topk}")
        check(self.moe_ffn_hidden_size is None or self.moe_ffn_hidden_size > 0, "moe_ffn_hidden_size",
              f"must be > 0, got {self.moe_ffn_hidden_size}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, name, f"must be a finite number >= 0, got {value}")
        check(self.moe_expert_capacity_factor is None or (math.isfinite(self.moe_expert_capacity_factor)
                                                           and self.moe_expert_capacity_factor > 0),
              "moe_expert_capacity_factor", f"must be > 0 (or null: dropless), got {self.moe_expert_capacity_factor}")
        for name in ("attention_dropout", "hidden_dropout"):
            check(getattr(self, name) == 0.0, name,
                  f"must be 0 for RL, got {getattr(self, name)}: old-policy log-probs are computed without dropout "
                  "and the update would apply it, so the importance ratio would not be 1 even on the first step")


@dataclass
class ParallelConfig:
    """Parallel layout. Data parallelism is whatever the world size leaves over.

    Read by: dpcc_megatron/megatron/, dpcc_megatron/train/setup.py.
    """

    tensor_model_parallel_size: int = 1
    """TP degree (shards heads, MLP and vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """PP degree (splits layers into stages)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved-schedule chunks per PP rank (VPP); None disables interleaving."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across DP ranks (ZeRO-1)."""
    recompute_granularity: Optional[Literal["selective", "full"]] = None
    """Activation recomputation: `selective` (attention core) or `full` (whole layers); None keeps all."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """With `full`: recompute uniformly divided layer groups, or the first N layers of each stage."""
    recompute_num_layers: int = 1
    """With `full`: layers per recompute group (`uniform`) or recomputed layers per stage (`block`)."""
    expert_model_parallel_size: int = 1
    """EP degree: each rank holds num_moe_experts / EP experts of every MoE layer. The expert groups
    are carved from TP x DP (Megatron's expert grid), so EP * expert TP must divide TP * DP."""
    expert_tensor_parallel_size: Optional[int] = None
    """TP degree inside each expert; None means tensor_model_parallel_size (Megatron's default)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts' ranks: all-to-all (sends each token only where it is routed),
    or all-gather (every EP rank sees every token; simpler, more traffic). Both run under gloo."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto picks nccl with CUDA, gloo otherwise."""
    distributed_timeout_minutes: int = 30
    """Collective timeout."""
    gradient_accumulation_fusion: Union[bool, Literal["auto"]] = "auto"
    """Accumulate weight gradients straight into the fp32 main-grad buffer inside the GEMM
    (TransformerConfig.gradient_accumulation_fusion). Needs CUDA and apex's
    `fused_weight_gradient_mlp_cuda` extension, which Megatron-Core's own ColumnParallelLinear
    (the output layer, also with the Transformer Engine spec) requires; TE layers fuse it
    themselves. auto: on where both are present, else off; true elsewhere is refused."""
    overlap_grad_reduce: Union[bool, Literal["auto"]] = "auto"
    """Overlap the data-parallel gradient all-reduce / reduce-scatter with the backward pass
    (DistributedDataParallelConfig.overlap_grad_reduce). auto: on with CUDA, off on CPU; true on CPU
    is refused (the overlap relies on CUDA stream ordering, CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    overlap_param_gather: Union[bool, Literal["auto"]] = "auto"
    """Overlap the distributed optimizer's parameter all-gather with the next forward
    (DistributedDataParallelConfig.overlap_param_gather); parameters are gathered in full before
    rollout, evaluation and checkpointing. Needs use_distributed_optimizer and overlap_grad_reduce
    (as Megatron-LM requires) and CUDA. auto: on where all hold; true elsewhere is refused."""
    deallocate_pipeline_outputs: Union[bool, Literal["auto"]] = "auto"
    """Free each pipeline stage's output activations once sent to the next stage (only their
    autograd graph is kept; TransformerConfig.deallocate_pipeline_outputs). Saves activation memory
    at PP > 1. auto: on with CUDA, off on CPU; true also runs on CPU."""

    def validate(self) -> None:
        check(self.tensor_model_parallel_size >= 1, "tensor_model_parallel_size",
              f"must be >= 1, got {self.tensor_model_parallel_size}")
        check(self.pipeline_model_parallel_size >= 1, "pipeline_model_parallel_size",
              f"must be >= 1, got {self.pipeline_model_parallel_size}")
        if self.virtual_pipeline_model_parallel_size is not None:
            check(self.virtual_pipeline_model_parallel_size >= 1, "virtual_pipeline_model_parallel_size",
                  f"must be >= 1, got {self.virtual_pipeline_model_parallel_size}")
            check(self.pipeline_model_parallel_size > 1, "virtual_pipeline_model_parallel_size",
                  "needs pipeline_model_parallel_size > 1 (or null)")
        check(not self.sequence_parallel or self.tensor_model_parallel_size > 1, "sequence_parallel",
              "needs tensor_model_parallel_size > 1")
        check(self.expert_model_parallel_size >= 1, "expert_model_parallel_size",
              f"must be >= 1, got {self.expert_model_parallel_size}")
        check(self.expert_tensor_parallel_size is None or self.expert_tensor_parallel_size >= 1,
              "expert_tensor_parallel_size", f"must be >= 1 (or null), got {self.expert_tensor_parallel_size}")
        check(self.recompute_num_layers >= 1, "recompute_num_layers", f"must be >= 1, got {self.recompute_num_layers}")
        check(self.distributed_timeout_minutes > 0, "distributed_timeout_minutes",
              f"must be > 0, got {self.distributed_timeout_minutes}")
        # Hardware-independent combinations (the machine is checked by megatron/performance.py).
        check(not (self.overlap_param_gather is True and not self.use_distributed_optimizer), "overlap_param_gather",
              "needs use_distributed_optimizer: true (it overlaps the distributed optimizer's all-gather)")
        check(not (self.overlap_param_gather is True and self.overlap_grad_reduce is False), "overlap_param_gather",
              "needs overlap_grad_reduce (auto or true), as in Megatron-LM")


@dataclass
class PrecisionConfig:
    """Training precision, FP8 and the sampler/trainer mismatch correction.

    Loss math (log-probs, ratios, KL, entropy, advantages) is fp32 whatever the training
    precision. Hardware and Transformer Engine checks run before the model is built
    (:func:`dpcc_megatron.megatron.precision.check_precision_environment`).
    Read by: dpcc_megatron/megatron/, dpcc_megatron/train/.
    """

    params_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training precision; bf16/fp16 use Megatron's mixed-precision optimizer with fp32 main weights."""
    transformer_engine: bool = False
    """Use Transformer Engine layer specs (requires the `gpu` extra)."""
    fp8: Optional[Literal["delayed", "current", "mxfp8"]] = None
    """FP8 recipe: delayed scaling, per-tensor current scaling, or MXFP8 block scaling (compute
    capability >= 10.0). Requires transformer_engine and params_dtype bf16."""
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    """FP8 format: hybrid (E4M3 forward, E5M2 gradients) or E4M3 everywhere."""
    fp8_amax_history_len: int = 1024
    """Delayed scaling: amax history length."""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"
    """Delayed scaling: how amax is taken from the history."""
    fp8_margin: int = 0
    """Delayed scaling: scale margin (the scale is divided by 2**margin)."""
    initial_loss_scale: float = 65536.0
    """FP16 dynamic loss scaling: starting scale."""
    min_loss_scale: float = 1.0
    """FP16 dynamic loss scaling: floor."""
    loss_scale_window: int = 1000
    """FP16: overflow-free steps before the scale doubles."""
    loss_scale_hysteresis: int = 2
    """FP16: overflow steps (counted down, reset by a window of clean steps) before the scale halves."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling against the sampler/trainer mismatch: each token's policy
    loss is multiplied by sg(min(pi_trainer_old / pi_sampler, tis_cap)). None: off."""

    def validate(self) -> None:
        check(self.fp8 is None or self.transformer_engine, "fp8",
              "requires precision.transformer_engine: true (FP8 runs only through Transformer Engine)")
        check(self.fp8 is None or self.params_dtype == "bf16", "fp8",
              f"requires params_dtype bf16, got {self.params_dtype}")
        check(self.fp8_amax_history_len >= 1, "fp8_amax_history_len", f"must be >= 1, got {self.fp8_amax_history_len}")
        check(self.fp8_margin >= 0, "fp8_margin", f"must be >= 0, got {self.fp8_margin}")
        check(self.initial_loss_scale > 0, "initial_loss_scale", f"must be > 0, got {self.initial_loss_scale}")
        check(0 < self.min_loss_scale <= self.initial_loss_scale, "min_loss_scale",
              f"must be in (0, initial_loss_scale], got {self.min_loss_scale}")
        check(self.loss_scale_window >= 1, "loss_scale_window", f"must be >= 1, got {self.loss_scale_window}")
        check(self.loss_scale_hysteresis >= 1, "loss_scale_hysteresis",
              f"must be >= 1, got {self.loss_scale_hysteresis}")
        check(self.tis_cap is None or (math.isfinite(self.tis_cap) and self.tis_cap >= 1.0), "tis_cap",
              f"must be a finite number >= 1 (or null to disable), got {self.tis_cap}")


def moe_layout_checks(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Cross-section checks of an MoE model and its expert-parallel layout, naming the key."""
    ep = parallel.expert_model_parallel_size
    tp = parallel.tensor_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or tp
    experts = model.num_moe_experts
    check(ep == 1 or experts is not None, "parallel.expert_model_parallel_size",
          f"is {ep} but the model has no experts (model.num_moe_experts is null)")
    if experts is None:
        return
    check(experts % ep == 0, "parallel.expert_model_parallel_size",
          f"must divide model.num_moe_experts={experts}, got {ep}")
    width = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    check(width % etp == 0, "parallel.expert_tensor_parallel_size",
          f"must divide the expert width (model.moe_ffn_hidden_size or ffn_hidden_size) {width}, got {etp}")
    # Megatron refuses to train MoE layers at TP > 1 without SP (each TP rank would route every token).
    check(tp == 1 or parallel.sequence_parallel, "parallel.sequence_parallel",
          f"must be true for a mixture-of-experts model at tensor_model_parallel_size={tp}")


__all__ = ["ModelConfig", "ParallelConfig", "PrecisionConfig", "moe_layout_checks"]
