"""Child process of the live NeMo test: NeMo 2.7.3 loads a NeMo 2 checkpoint as its users do.

    python -m tests.convert.nemo_live_worker CKPT TOKENS.pt OUT.pt

``load_context(CKPT/context, subpath="model")`` rebuilds the model from io.json (unbuilt first,
to switch off the fusions that need Transformer Engine, then ``fdl.build``); the weights
are restored by NeMo's own inference path (``_setup_trainer_and_restore_model``: strategy
setup, then ``selective_restore`` of ``CKPT/weights``). Writes {"state": the Megatron model's
state dict, "logits": NeMo's forward on the tokens, "model_class", "config_class"} to OUT.pt.
Needs NeMo.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
           "persist_layer_norm", "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "moe_grouped_gemm",
           "moe_permute_fusion")


def te_named_local_spec(config):
    """NeMo's own fallback without Transformer Engine (the local spec), checkpointing an MoE layer's
    norm under the name the TE spec gives it (``pre_mlp_layernorm``), as NeMo does on GPUs; the
    local spec alone stores it under the dense layer's fused norm name."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    if config.num_moe_experts:
        spec.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.")
    return spec


def main(ckpt: str, tokens_file: str, out_file: str) -> None:
    import fiddle as fdl
    import torch
    from nemo import lightning as nl
    from nemo.collections.llm.inference.base import _setup_trainer_and_restore_model
    from nemo.lightning.io import load_context

    # NeMo's Llama/Qwen2 configs default to fusions that need Transformer Engine (their
    # constructor refuses apply_rope_fusion without it): take the config unbuilt, switch them off.
    config = load_context(Path(ckpt) / "context", subpath="model", build=False)
    for name in FUSIONS:
        setattr(config.config, name, False)
    config.config.use_cpu_initialization = True
    config.config.transformer_layer_spec = te_named_local_spec
    if config.config.num_moe_experts:  # the all-to-all dispatcher makes a CUDA stream; at EP=1 both are exact
        config.config.moe_token_dispatcher_type = "allgather"
    model = fdl.build(config)
    # NeMo's checkpoint IO ends its load with _fix_tensors_device, which asserts CUDA is initialised
    # and moves CUDA tensors to the current CUDA device; on CPU there is nothing to move.
    import nemo.lightning.io.pl as nemo_pl

    nemo_pl._fix_tensors_device = lambda ckpt: ckpt
    trainer = nl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         strategy=nl.MegatronStrategy(ckpt_save_optimizer=False, ckpt_async_save=False))
    _setup_trainer_and_restore_model(Path(ckpt), trainer, model)

    from dpcc_megatron.testing import enable_cpu_megatron
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    enable_cpu_megatron()  # Megatron-Core's forward asks for the CUDA device and RNG tracker
    from dpcc_megatron.megatron.model import _moe_without_te

    _moe_without_te()  # megatron-core 0.16.1's router names te_general_gemm even without TE
    model_parallel_cuda_manual_seed(0)
    tokens = torch.load(tokens_file)
    model.eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        logits = model(input_ids=tokens, position_ids=pos, attention_mask=None)
    state = {k[len("module."):]: v.detach().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    tok = model.tokenizer
    torch.save({"state": state, "logits": logits.float().clone(), "model_class": type(model).__name__,
                "config_class": type(model.config).__name__, "tokenizer_class": type(tok).__name__,
                "tokenizer_path": tok.tokenizer.name_or_path, "token_ids": tok.text_to_ids("w7 w3 zzz")},
               out_file)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main(*sys.argv[1:4])
