"""Tiny random Hugging Face models for the conversion tests, built offline from configs.

Every parameter gets noise on top of HF's init, so norms and biases are not ones/zeros and
a mapping mistake anywhere shows up in the logits. Vocabulary 100 is padded by Megatron
(128 at TP=1, 256 at TP=2), so padding is exercised.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

VOCAB = 100

FAMILIES = {
    # Llama 3.1 style: GQA, llama3 rope scaling, untied.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    # Qwen2.5 small style: QKV bias, tied embeddings, stored in bf16.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0)),
    # Mistral style: 4:1 GQA, head_dim != hidden/heads, untied.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False)),
    # Qwen3 dense: QK layernorm, head_dim != hidden/heads, tied.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=1000000.0)),
    # Qwen3-MoE (30B-A3B style): QK layernorm, 8 experts, top-2 renormalised, expert width != dense width.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=False)),
    # Mixtral: 4 experts, top-2 (softmax over the top-2 logits), untied.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=32, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=None,
        tie_word_embeddings=False)),
}


def build_hf(family: str, out: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0,
             max_shard_size: str | None = None, tokenizer: bool = False, **overrides):
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, **{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = model.to(dtype)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **extra)
    if tokenizer:
        save_tokenizer(out)
    return model


def save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<unk>"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(out))


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    from dpcc_megatron.convert.verify import hf_logits as _logits

    return _logits(path, tokens)


def assert_one_rank_matches_hf(ranks: list[dict], key, hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Exactly one rank of a multi-rank forward returned logits under ``key``, and they equal the HF
    forward of ``hf_dir`` within 1e-4; returns the HF logits."""
    ref = hf_logits(hf_dir, tokens)
    got = [r[key] for r in ranks if r[key] is not None]
    assert len(got) == 1, "exactly one rank returns logits"
    assert got[0].shape == ref.shape == (*tokens.shape, VOCAB)
    torch.testing.assert_close(got[0], ref, atol=1e-4, rtol=0)
    return ref


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors directory (one file or an index of shards)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def edit_weights(src: Path, dst: Path, edit) -> None:
    """Copy a single-file HF directory, applying ``edit(tensors)`` in place to its weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Run ``dpcc-megatron ARGV`` in this process; (exit code, stdout, stderr)."""
    from dpcc_megatron.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def try_loads(attempts: dict, parallel) -> dict:
    """In a rank of a multi-rank job: for each ``name: (checkpoint, config to build, job model
    section or None)``, build the model at ``parallel`` and load the checkpoint into it. Returns
    ``name: ConversionError text``, or None where it loaded."""
    from dpcc_megatron.convert import ConversionError, load_mcore_checkpoint
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel

    out = {}
    for name, (ckpt, build_cfg, job_cfg) in attempts.items():
        init_model_parallel(parallel)
        try:
            load_mcore_checkpoint([build_gpt_model(build_cfg, parallel)], ckpt, job_cfg)
            out[name] = None
        except ConversionError as e:
            out[name] = str(e)
        finally:
            destroy_model_parallel()
    return out


def resave(ckpt, cfg, parallel, trained, iteration: int, carry: bool = False) -> None:
    """In a rank: load ``ckpt`` at ``parallel`` and save it with the trainer's checkpoint writer; with
    ``carry``, as the trainer saves a run started from ``ckpt`` (its source files and provenance)."""
    from dpcc_megatron.config import to_dict
    from dpcc_megatron.convert import load_mcore_checkpoint
    from dpcc_megatron.megatron.checkpoint import save_checkpoint
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(parallel)
    try:
        model = build_gpt_model(cfg, parallel)
        load_mcore_checkpoint([model], ckpt, cfg)
        state, add = {"model": to_dict(cfg)}, None
        if carry:
            from dpcc_megatron.convert.provenance import carried_from, copy_carried

            source, files = carried_from(str(ckpt))
            state["source"] = source
            add = lambda d: copy_carried(files, d)  # noqa: E731
        save_checkpoint(trained, iteration, [model], None, None, state, add_files=add)
    finally:
        destroy_model_parallel()


def vpp_mismatches(cfg, ckpt) -> list[str]:
    """In a 2-rank job: load ``ckpt`` (4 layers) at PP=2 x VPP=2 (two chunks per rank) and name every
    parameter that differs from a TP=1/PP=1 load."""
    from dpcc_megatron.config import ParallelConfig
    from dpcc_megatron.convert import load_mcore_checkpoint
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors, shard_like

    single = ParallelConfig()
    init_model_parallel(single)
    try:
        model = build_gpt_model(cfg, single)
        load_mcore_checkpoint([model], ckpt)
        full = local_named_tensors([model])
    finally:
        destroy_model_parallel()
    vpp = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    init_model_parallel(vpp)
    try:
        chunks = [build_gpt_model(cfg, vpp, vp_stage=i) for i in range(2)]
        load_mcore_checkpoint(chunks, ckpt, cfg)
        got, want = local_named_tensors(chunks), shard_like(chunks, full, 0, 1)
        assert set(got) == set(want) and len(got) >= 2 * 6, sorted(got)  # two layers of six tensors
        return [name for name in got if not torch.equal(got[name], want[name])]
    finally:
        destroy_model_parallel()
