"""The rollout-engine interface and its failure paths that need no engine process (milliseconds)."""
import os
import sys

import pytest
import torch

from dpcc_megatron.rollout.engine import EngineStartError, Generation, Sampling


def test_generation_checks_its_rows():
    Generation([[1, 2]], [torch.zeros(2)], [True])
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        Generation([[1, 2]], [torch.zeros(1)], [True])
    with pytest.raises(ValueError, match="finish flags"):
        Generation([[1]], [torch.zeros(1)], [])


def test_rollout_engine_key_is_validated():
    from dpcc_megatron.config import ConfigError, load_config

    assert load_config(overrides=["rollout.engine=vllm"]).rollout.engine == "vllm"
    assert load_config().rollout.engine == "megatron"
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(overrides=["rollout.engine=sglang"])


def test_vllm_refuses_a_model_it_cannot_serve_naming_the_key():
    from dpcc_megatron.testing.tiny import tiny_model_config
    from dpcc_megatron.train.engines import build_vllm_engine

    cfg = tiny_model_config(normalization="LayerNorm")
    with pytest.raises(EngineStartError, match="rollout.engine: vllm cannot serve this model"):
        build_vllm_engine(None, cfg, "fp32", vocab_size=200, eos_id=1, model_dir="unused", host=True)


def test_missing_vllm_names_the_extra(monkeypatch):
    from dpcc_megatron.rollout import vllm_engine

    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_INSECURE_SERIALIZATION",
              "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(k, os.environ.get(k, ""))
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(EngineStartError, match=r"rollout.engine: vllm needs the vllm-cpu extra.*\[vllm-cpu\]"):
        vllm_engine.import_vllm()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # in-process engines hang in the trainer's world


def test_vllm_checksum_names_cover_every_layer():
    from dpcc_megatron.convert.layout import all_hf_shapes
    from dpcc_megatron.rollout.vllm_engine import checksum_names
    from dpcc_megatron.testing.tiny import tiny_model_config

    names = checksum_names([n for n, _ in all_hf_shapes(tiny_model_config(num_layers=3))])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names and "model.norm.weight" in names
    for i in range(3):
        assert f"model.layers.{i}.input_layernorm.weight" in names
        assert f"model.layers.{i}.post_attention_layernorm.weight" in names
