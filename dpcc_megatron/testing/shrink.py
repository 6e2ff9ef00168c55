"""Shrink a shipped job config to a tiny model that trains on a few CPU ranks, keeping its flags.

    cfg, dropped = shrink_for_cpu(load_config("examples/llama3_70b.yaml"), out_dir)

Kept: the architecture's switches (normalization, SwiGLU, QKV bias, GQA, RoPE base, tied
embeddings), sequence parallelism, virtual pipeline size, distributed optimizer, params_dtype,
micro-batch size, loss, optimizer and sampling settings. Shrunk: every dimension, TP and PP to at
most 2 (each stays > 1 where it was, so SP and interleaving still run), the batch, the rollout
and the run length. Dropped, because a CPU cannot run them: Transformer Engine and FP8, and the
NCCL backend (gloo instead); prompts, the held-out eval file, tokenizer and the initial
checkpoint become the built-in synthetic task, the character tokenizer and a random init. ``dropped`` names each dropped key.
"""
from __future__ import annotations

import copy

MAX_TP = 2
MAX_PP = 2


def shrink_for_cpu(cfg, out_dir: str, *, iterations: int = 2):
    """-> (a new config, list of "key: was -> now" for the settings the CPU cannot keep)."""
    from ..config import validate_tree

    cfg = copy.deepcopy(cfg)
    dropped = []
    m, par, prec = cfg.model, cfg.parallel, cfg.precision
    tp = min(par.tensor_model_parallel_size, MAX_TP)
    pp = min(par.pipeline_model_parallel_size, MAX_PP)
    vpp = par.virtual_pipeline_model_parallel_size if pp > 1 else None
    par.tensor_model_parallel_size, par.pipeline_model_parallel_size = tp, pp
    par.virtual_pipeline_model_parallel_size = vpp
    if par.backend == "nccl":
        dropped.append("parallel.backend: nccl -> gloo")
        par.backend = "gloo"
    if prec.transformer_engine:
        dropped.append("precision.transformer_engine: true -> false")
        prec.transformer_engine = False
    if prec.fp8 is not None:
        dropped.append(f"precision.fp8: {prec.fp8} -> null")
        prec.fp8 = None

    # One layer per virtual chunk (two without a pipeline); heads and K/V groups that TP=2 splits.
    gqa = m.num_query_groups is not None and m.num_query_groups < m.num_attention_heads
    m.num_layers = pp * (vpp or 1) if pp > 1 else 2
    m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = 32, 64, 4
    m.num_query_groups = 2 if gqa else None
    m.kv_channels = None
    m.vocab_size, m.make_vocab_size_divisible_by, m.max_seq_len = 128, 32, 32

    cfg.data.prompts, cfg.data.tokenizer, cfg.data.synthetic_digits = None, "char", 1
    if cfg.eval.data is not None:  # a held-out file of the real dataset: the synthetic task's eval instead
        dropped.append(f"eval.data: {cfg.eval.data} -> null")
        cfg.eval.data = None
    r = cfg.rollout
    r.group_size, r.prompts_per_iteration, r.max_new_tokens = 4, 4, 3
    cfg.data.max_prompt_len = m.max_seq_len - r.max_new_tokens  # generation always fits the context
    r.batch_size = min(r.batch_size, 16)
    t = cfg.train
    t.iterations, t.mini_batch_size, t.output_dir, t.exit_interval = iterations, 8, str(out_dir), 0
    ck = cfg.checkpoint
    ck.dir, ck.load, ck.save_interval, ck.keep_last = f"{out_dir}/ck", None, iterations, 1
    cfg.monitor.enabled = False
    validate_tree(cfg)
    return cfg, dropped


__all__ = ["shrink_for_cpu"]
