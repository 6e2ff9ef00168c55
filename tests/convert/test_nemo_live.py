"""Live NeMo (opt-in: ``-m nemo``, needs the ``nemo`` extra): a policy trained here, written with
``convert mcore-to-nemo``, is loaded by NeMo 2.7.3 itself (``load_context`` rebuilds the model
and its tokenizer from our io.json, NeMo's restore reads our weights/), and NeMo's weights and
logits equal ours, for Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral.

Skipped where NeMo is not installed; the default suite covers the same files against the
committed NeMo-made fixture instead (test_nemo_checkpoint.py).
"""
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpcc_megatron.config import ModelConfig
from dpcc_megatron.testing import run_multirank

from .hf_models import run_cli, save_tokenizer
from .nemo_helpers import redraw

pytestmark = [pytest.mark.nemo, pytest.mark.multirank,
              pytest.mark.skipif(importlib.util.find_spec("nemo") is None, reason="NeMo is not installed")]

ROOT = Path(__file__).resolve().parents[2]
BASE = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                   vocab_size=100, max_seq_len=64, rotary_base=10000.0)
QWEN3 = dataclasses.replace(BASE, qk_layernorm=True, kv_channels=8, norm_epsilon=1e-6, rotary_base=1000000.0)
CASES = {"llama": (dataclasses.replace(BASE, tie_embeddings=False), "LlamaModel", "LlamaConfig"),
         "qwen2": (dataclasses.replace(BASE, add_qkv_bias=True, tie_embeddings=True, norm_epsilon=1e-6,
                                       rotary_base=1000000.0), "Qwen2Model", "Qwen2Config"),
         "qwen3": (dataclasses.replace(QWEN3, tie_embeddings=True), "Qwen3Model", "Qwen3Config"),
         "qwen3_moe": (dataclasses.replace(QWEN3, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32),
                       "Qwen3Model", "Qwen3MoEConfig"),
         "mixtral": (dataclasses.replace(BASE, num_moe_experts=4, moe_router_topk=2, rotary_base=1000000.0),
                     "MixtralModel", "MixtralConfig")}
TOKENS = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))


def _policy_and_conversion(rank, world, cfg, root):
    """Child: a policy with weights far from init saved by the trainer's writer, our logits of it,
    and the mcore-to-nemo conversion."""
    from dpcc_megatron.config import ParallelConfig, to_dict
    from dpcc_megatron.convert.verify import mcore_logits
    from dpcc_megatron.megatron.checkpoint import save_checkpoint
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors

    parallel = ParallelConfig()
    init_model_parallel(parallel)
    try:
        model = build_gpt_model(cfg, parallel)
        redraw(model, 11)
        save_checkpoint(root / "policy", 7, [model], None, None, {"model": to_dict(cfg)})
        state = local_named_tensors([model])
    finally:
        destroy_model_parallel()
    logits = mcore_logits(root / "policy", TOKENS, 1, 1)
    save_tokenizer(root / "tokenizer")
    rc, out, err = run_cli(["convert", "mcore-to-nemo", "--mcore", str(root / "policy"), "--out", str(root / "nemo"),
                            "--no-progress", "--tokenizer", str(root / "tokenizer")])
    assert rc == 0, err
    return state, logits


@pytest.mark.parametrize("family", sorted(CASES))
def test_nemo_loads_our_checkpoint(family, tmp_path):
    cfg, model_class, config_class = CASES[family]
    ours, our_logits = run_multirank(_policy_and_conversion, 1, args=(cfg, tmp_path), timeout=600)[0]
    torch.save(TOKENS, tmp_path / "tokens.pt")
    proc = subprocess.run([sys.executable, "-m", "tests.convert.nemo_live_worker", str(tmp_path / "nemo"),
                           str(tmp_path / "tokens.pt"), str(tmp_path / "nemo_out.pt")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "nemo_out.pt")
    assert (got["model_class"], got["config_class"]) == (model_class, config_class)
    # NeMo built the tokenizer io.json names, from the copy in context/nemo_tokenizer.
    assert got["tokenizer_class"] == "AutoTokenizer"
    assert got["tokenizer_path"] == str(tmp_path / "nemo" / "context" / "nemo_tokenizer")
    assert got["token_ids"] == [7, 3, 99]

    # Weights: every tensor of NeMo's model equals ours (our vocabulary rows beyond vocab_size are padding).
    from dpcc_megatron.convert.layout import canonical_name

    theirs = {canonical_name(k): v for k, v in got["state"].items()}
    ours = {canonical_name(k): v for k, v in ours.items()}
    assert set(theirs) == set(ours), sorted(set(theirs) ^ set(ours))
    for name, t in theirs.items():
        want = ours[name][: t.shape[0]] if t.shape[0] == cfg.vocab_size else ours[name]
        assert torch.equal(t, want), name

    # Logits of NeMo's forward equal ours within 1e-5 (NeMo's are over its unpadded vocabulary).
    assert got["logits"].shape == our_logits.shape == (*TOKENS.shape, cfg.vocab_size)
    diff = float((got["logits"] - our_logits).abs().max())
    assert diff <= 1e-5, diff
    assert float(our_logits.abs().max()) > 1.0  # not a trivially flat model
