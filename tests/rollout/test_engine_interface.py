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


def _restore_vllm_env(monkeypatch):
    """import_vllm sets these for the process: put them back after the test."""
    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_INSECURE_SERIALIZATION",
              "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(k, os.environ.get(k, ""))


def test_missing_vllm_names_the_extra(monkeypatch):
    from dpcc_megatron.rollout import vllm_engine

    _restore_vllm_env(monkeypatch)
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


class _FakeMetadata:
    """importlib.metadata with one vLLM distribution and chosen torch/transformers versions."""

    PackageNotFoundError = type("PackageNotFoundError", (Exception,), {})

    def __init__(self, versions, requires):
        self.versions, self.requires = versions, requires

    def distribution(self, name):
        if name not in self.versions:
            raise self.PackageNotFoundError(name)
        return type("Dist", (), {"requires": self.requires})()

    def version(self, name):
        if name not in self.versions:
            raise self.PackageNotFoundError(name)
        return self.versions[name]


REQUIRES = ['transformers<5.20.0,>=5.16.1', 'torch==2.13.0+cpu; platform_machine == "x86_64"',
            'torchvision; platform_machine != "riscv64"']


def test_vllm_version_problems_name_the_package(monkeypatch):
    from dpcc_megatron.rollout import vllm_engine

    real = vllm_engine.version_problems
    ok = _FakeMetadata({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0"}, REQUIRES)
    assert real(ok) == []
    bad = _FakeMetadata({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.21.0"}, REQUIRES)
    (msg,) = real(bad)
    assert msg == "vllm-cpu 0.32.0 requires transformers<5.20.0,>=5.16.1 but transformers 5.21.0 is installed"
    missing = _FakeMetadata({"vllm-cpu": "0.32.0", "transformers": "5.19.0"}, REQUIRES)
    assert real(missing) == ["vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which is not installed"]

    # import_vllm refuses before importing vllm, naming the package and the extra
    _restore_vllm_env(monkeypatch)
    monkeypatch.setattr(vllm_engine, "version_problems", lambda: real(bad))
    monkeypatch.setitem(sys.modules, "vllm", None)  # would be an ImportError: the version check comes first
    with pytest.raises(EngineStartError, match=r"requires transformers<5\.20\.0.*5\.21\.0 is installed.*vllm-cpu extra"):
        vllm_engine.import_vllm()


def test_shared_weights_round_trip_and_reuse(tmp_path):
    """What a refit puts in shared memory is what the worker's views read, dtype, shape and values."""
    from dpcc_megatron.rollout.vllm_engine import SharedWeights, _shared_pairs

    g = torch.Generator().manual_seed(0)
    pairs = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.randn(2, 2, 2, generator=g).half())]
    shm = SharedWeights(str(tmp_path))
    path, nbytes, specs = shm.pack(pairs)
    got = _shared_pairs(path, nbytes, specs)
    assert [n for n, _ in got] == ["a", "b", "c"]
    for (n, t), (_, u) in zip(pairs, got):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
    moved = [(n, t * 2) for n, t in pairs]
    assert shm.pack(moved)[0] == path  # the same file, rewritten
    for (n, t), (_, u) in zip(moved, _shared_pairs(path, nbytes, specs)):
        assert torch.equal(u, t)
    shm.close()
    assert not list(tmp_path.iterdir())  # the file is removed


def test_a_dead_engine_process_is_an_error_not_a_hang():
    """vllm's synchronous client can wait forever on a dead engine core: call_watched raises instead."""
    import threading
    import time
    from types import SimpleNamespace

    from dpcc_megatron.rollout.vllm_engine import call_watched

    proc = SimpleNamespace(name="EngineCore", pid=123, exitcode=None)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[proc])))))
    assert call_watched(llm, "generate", lambda: 7, poll_s=0.01) == 7
    with pytest.raises(KeyError):  # the call's own errors come through
        call_watched(llm, "generate", lambda: {}["x"], poll_s=0.01)
    threading.Timer(0.2, lambda: setattr(proc, "exitcode", -9)).start()
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"vLLM engine died during generate: EngineCore \(pid 123\) exited with code -9"):
        call_watched(llm, "generate", threading.Event().wait, poll_s=0.01, grace_s=0.05)  # blocks forever
    assert time.time() - t0 < 5
