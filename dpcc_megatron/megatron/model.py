"""Build a Megatron-Core ``GPTModel`` from the typed config.

The spec is Megatron's local spec (CPU, and GPUs without Transformer Engine) or
the Transformer Engine spec when ``precision.transformer_engine`` is set.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..config import ModelConfig, ParallelConfig, PrecisionConfig
from .performance import resolve as resolve_performance
from .performance import transformer_config_kwargs
from .precision import check_precision_environment, fp8_transformer_fields, te_layer_spec

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def ffn_hidden_size(model: ModelConfig) -> int:
    return model.ffn_hidden_size or 4 * model.hidden_size


def transformer_config(model: ModelConfig, parallel: ParallelConfig,
                       precision: Optional[PrecisionConfig] = None):
    """Map our config onto ``megatron.core.transformer.TransformerConfig``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    precision = precision or PrecisionConfig()
    dtype = _DTYPES[precision.params_dtype]
    cfg = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=ffn_hidden_size(model),
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision.params_dtype == "bf16",
        fp16=precision.params_dtype == "fp16",
        # These fusions need apex/TE kernels; the unfused paths are exact and portable.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        # gradient_accumulation_fusion, deallocate_pipeline_outputs: per machine (megatron/performance.py)
        **transformer_config_kwargs(resolve_performance(parallel)),
        recompute_granularity=parallel.recompute_granularity,
        recompute_method=parallel.recompute_method if parallel.recompute_granularity == "full" else None,
        recompute_num_layers=parallel.recompute_num_layers if parallel.recompute_granularity == "full" else None,
        **fp8_transformer_fields(precision),
        qk_layernorm=model.qk_layernorm,
        **moe_transformer_fields(model, parallel),
    )
    if parallel.virtual_pipeline_model_parallel_size:
        # Interleaved 1F1B sends activations and gradients both ways between the same two ranks
        # (at PP=2 the previous and next stage are one rank). Batched p2p posts them as
        # send_prev, recv_prev, send_next, recv_next on every rank, so rank A's first send to B
        # (a gradient) meets B's first receive from A (an activation): the tensors swap (measured
        # under gloo: micro-batches 3-4 of 4 gave losses off by 2e-3). Individual isend/irecv use
        # Megatron's even/odd ordering, which pairs them correctly.
        cfg.batch_p2p_comm = False
    # Set after construction: the constructor's MoE check rejects it for dense models,
    # but the pipeline schedule needs it to exchange shapes when lengths vary per batch.
    # Not under interleaving: the shape exchange always uses batched p2p, which pairs the
    # messages wrongly there and, at the warm-up/steady-state boundary, deadlocks under gloo.
    # It is not needed anyway: every micro-batch of one schedule call has the call's seq_length.
    cfg.variable_seq_lengths = not parallel.virtual_pipeline_model_parallel_size
    return cfg


def check_moe_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse an expert-parallel layout the model cannot use, naming the key (a ConfigError)."""
    from types import SimpleNamespace

    from ..config.base import run_validate
    from ..config.model import moe_layout_checks

    run_validate(SimpleNamespace(validate=lambda: moe_layout_checks(model, parallel)), "")


def moe_transformer_fields(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """The TransformerConfig fields of the MoE layers (empty for a dense model)."""
    if model.num_moe_experts is None:
        return {}
    check_moe_layout(model, parallel)
    return dict(
        num_moe_experts=model.num_moe_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or ffn_hidden_size(model),
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff or None,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor,
        moe_token_dispatcher_type=parallel.moe_token_dispatcher_type,
        moe_grouped_gemm=False,  # SequentialMLP: one expert per module, exact on CPU and GPU
        moe_permute_fusion=False,
        moe_enable_routing_replay=True,  # idle unless megatron/routing_replay.py drives it
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size,
    )


def _moe_without_te() -> None:
    """megatron-core 0.16.1's router gating names ``te_general_gemm`` even when Transformer Engine
    is absent (its import failed, so the name is undefined); give it the value its fallback tests."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def layer_spec(model: ModelConfig, precision: PrecisionConfig, config=None, vp_stage: Optional[int] = None):
    """The layer spec; with ``config.sequence_parallel`` on the local spec, torch norms are swapped
    for :class:`~dpcc_megatron.megatron.norms.SequenceParallelTorchNorm` (Megatron's own refuses SP)."""
    if precision.transformer_engine:
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise RuntimeError("precision.transformer_engine is set but Transformer Engine is not installed "
                               "(pip install 'dpcc-megatron[gpu]')") from e
        if model.num_moe_experts is not None or model.qk_layernorm:
            raise RuntimeError("precision.transformer_engine with model.num_moe_experts or model.qk_layernorm is "
                               "not supported yet: the model is built with the local spec only")
        return te_layer_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if model.num_moe_experts is not None:
        _moe_without_te()
    spec = get_gpt_layer_local_spec(num_experts=model.num_moe_experts, qk_layernorm=model.qk_layernorm,
                                    normalization=model.normalization)
    if config is not None and config.sequence_parallel:
        from .norms import sequence_parallel_local_spec, uses_torch_norm

        if uses_torch_norm(spec):
            return sequence_parallel_local_spec(spec, config, vp_stage)
    return spec


def _accepts(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def build_gpt_model(model: ModelConfig, parallel: ParallelConfig, precision: Optional[PrecisionConfig] = None,
                    *, pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                    vp_stage: Optional[int] = None):
    """One model chunk for this rank. Parallel state must be initialised."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    precision = precision or PrecisionConfig()
    check_precision_environment(precision)  # FP8/TE/bf16 vs this machine, before any allocation
    tp = parallel.tensor_model_parallel_size
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    rope = model.rope_scaling or {}
    kwargs = {}
    if rope:
        if rope.get("rope_type", rope.get("type")) != "llama3":
            raise ValueError(f"model.rope_scaling: only llama3 scaling is supported, got {rope}")
        # Megatron hard-codes the Llama 3.1 frequency bands; other values would be silently ignored.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in fixed.items():
            if key in rope and float(rope[key]) != value:
                raise ValueError(f"model.rope_scaling.{key}={rope[key]} is not supported: Megatron-Core's llama3 "
                                 f"scaling uses {value}")
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(rope.get("factor", 8.0)))
    if float(model.rotary_base) != int(model.rotary_base):
        raise ValueError(f"model.rotary_base must be a whole number for Megatron-Core, got {model.rotary_base}")
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
        if not _accepts(GPTModel.__init__, "vp_stage"):  # pragma: no cover - megatron-core < 0.13
            raise RuntimeError("parallel.virtual_pipeline_model_parallel_size needs a megatron-core whose "
                               "GPTModel accepts vp_stage (>= 0.13)")
    tcfg = transformer_config(model, parallel, precision)
    gpt = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec(model, precision, tcfg, vp_stage),
        vocab_size=padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp),
        max_sequence_length=model.max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding_type,
        rotary_base=int(model.rotary_base),
        **kwargs,
    )
    if model.num_moe_experts is not None:
        _forget_global_router_replays(gpt)
    _params_to_dtype(gpt, _DTYPES[precision.params_dtype])
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    return gpt


def _forget_global_router_replays(gpt) -> None:
    """Each router keeps its own RouterReplay; drop them from Megatron's process-global list, which
    would otherwise grow with every model built in the process (routing_replay.py never uses it)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = {id(m.router_replay) for m in gpt.modules() if getattr(m, "router_replay", None) is not None}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]


def _params_to_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter in ``params_dtype``, as Megatron-LM's Float16Module leaves them.

    Without apex or TE, Megatron's norms fall back to torch norms whose weights are created in
    fp32 whatever ``params_dtype`` says; the mixed-precision optimizer then puts them in a separate
    fp32 group that its ``sharded_state_dict`` cannot map ("Param id ... does not match any model
    sharded param"), so a bf16 run without the distributed optimizer could not checkpoint."""
    if dtype == torch.float32:
        return
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
