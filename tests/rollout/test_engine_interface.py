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
        build_vllm_engine(None, cfg, "fp32", vocab_size=200, eos_id=1, host=True)


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


def test_shared_slot_round_trip_and_nothing_left_in_the_mount(tmp_path):
    """A bucket written into the slot is what the worker's mapping reads, after the file was unlinked."""
    from dpcc_megatron.rollout.vllm_engine import SharedSlot

    slot = SharedSlot(4096, str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(slot.path)]
    worker_view = torch.from_file(slot.path, shared=True, size=slot.nbytes, dtype=torch.uint8)  # as a worker maps it
    slot.unlink()
    assert not list(tmp_path.iterdir())  # gone from the mount, still mapped by both sides
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=g), torch.randn(7, generator=g)
    slot.buf[:60].view(torch.float32).view(3, 5).copy_(a)
    slot.buf[64:92].view(torch.float32).copy_(b)
    assert torch.equal(worker_view[:60].view(torch.float32).view(3, 5), a)
    assert torch.equal(worker_view[64:92].view(torch.float32), b)
    slot.close()


def test_a_worker_refuses_a_bucket_its_rank_has_not_finished_writing(tmp_path):
    """The worker loads a bucket only when its mapping holds exactly what its trainer rank wrote
    (:func:`bucket_checksum`, exact for any tensor, sharded or not): a stale or half-written bucket is an
    error before anything reaches the model."""
    from types import SimpleNamespace

    from dpcc_megatron.rollout import vllm_engine
    from dpcc_megatron.rollout.vllm_engine import SharedSlot, _load_bucket_in_worker, bucket_checksum

    slot = SharedSlot(4096, str(tmp_path))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=g), torch.randn(7, generator=g)
    entries = [("a.weight", (3, 5), 0, 60), ("b.weight", (7,), 64, 28)]  # 92 bytes: 11 words and 4 bytes
    slot.buf[:60].view(torch.float32).view(3, 5).copy_(a)
    slot.buf[64:92].view(torch.float32).copy_(b)
    written = bucket_checksum(slot.buf, entries)
    loaded = []
    runner = SimpleNamespace(reload_weights=lambda weights_iterator: loaded.extend(
        (n, t.clone()) for n, t in weights_iterator))
    worker = SimpleNamespace(rank=1, model_runner=runner)
    vllm_engine._WORKER_SLOT["buf"] = torch.from_file(slot.path, shared=True, size=slot.nbytes, dtype=torch.uint8)
    try:
        slot.buf[90] ^= 1  # the last byte of b, in the trailing partial word: the rank is still writing
        with pytest.raises(RuntimeError, match=r"worker 1 read bytes with checksum .* trainer rank wrote"):
            _load_bucket_in_worker(entries, "float32", False, [], {1: (None, written)}, worker)
        assert loaded == []  # nothing reached the model
        slot.buf[90] ^= 1
        assert _load_bucket_in_worker(entries, "float32", False, [], {1: (None, written)}, worker) is None
        assert [n for n, _ in loaded] == ["a.weight", "b.weight"]
        assert torch.equal(loaded[0][1], a) and torch.equal(loaded[1][1], b)
    finally:
        vllm_engine._WORKER_SLOT.clear()
        slot.close()
    # exact integer arithmetic: a changed word anywhere changes it, the order of summation does not
    x = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    whole = [("x", (1024,), 0, 4096)]
    assert bucket_checksum(x, whole) == bucket_checksum(x.view(-1, 8).flip(0).reshape(-1).clone(), whole)
    y = x.clone()
    y[4000] ^= 0x80
    assert bucket_checksum(y, whole) != bucket_checksum(x, whole)


def test_a_too_small_shm_mount_is_a_clear_error_naming_the_key(tmp_path):
    """A real 1 MiB tmpfs (in a private mount namespace): a 4 MiB bucket is refused before any write,
    with an error naming rollout.vllm.refit_bucket_mb, and no file is left (no Bus error)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    script = (
        "import os, sys\n"
        "from dpcc_megatron.rollout.vllm_engine import SharedSlot\n"
        "from dpcc_megatron.rollout.engine import RefitError\n"
        "d = sys.argv[1]\n"
        "small = SharedSlot(256 * 1024, d); small.close()\n"
        "try:\n"
        "    SharedSlot(4 * 2**20, d)\n"
        "except RefitError as e:\n"
        "    print('ERROR', e)\n"
        "print('LEFT', sorted(os.listdir(d)))\n")
    out = subprocess.run(["unshare", "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} -c \"$0\" {mnt}", script],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERROR rollout.vllm.refit_bucket_mb: a refit bucket of 4.0 MiB does not fit the shared-memory mount" \
        in out.stdout, out.stdout
    assert "LEFT []" in out.stdout


def test_a_killed_process_leaves_nothing_in_the_mount(tmp_path):
    """SIGKILL of a rank after its slot is mapped by its worker (the state during a refit): the file was
    already unlinked, so nothing stays in the mount."""
    import signal
    import subprocess

    script = ("import sys, time, torch\n"
              "from dpcc_megatron.rollout.vllm_engine import SharedSlot\n"
              "s = SharedSlot(1 << 20, sys.argv[1])\n"
              "w = torch.from_file(s.path, shared=True, size=s.nbytes, dtype=torch.uint8)\n"
              "s.unlink(); s.buf.fill_(7)\n"
              "print('READY', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(tmp_path.iterdir())


def test_only_this_engines_vllm_shm_files_are_removed(tmp_path):
    """vllm-cpu's communicator files: an engine removes those named by its own identity, and after a failed
    start only new ones that no live process maps; another engine's (mapped) or older files stay."""
    import mmap

    from dpcc_megatron.rollout.vllm_engine import remove_orphaned_vllm_shm, remove_vllm_shm, vllm_shm_files

    mine, other = "vllm_dist_" + "a" * 32, "vllm_dist_" + "b" * 32
    names = [f"{mine}-tp:0-[0-1]-cpushm_0", f"{mine}-tp:0-[0-1]-cpushm_1", f"{other}-tp:0-[0-1]-cpushm_0",
             "vllm_dist_" + "c" * 32 + "-tp:0-[0-1]-cpushm_0", "dpcc-refit-1-x", f"{mine}.lock"]
    for n in names:
        (tmp_path / n).write_bytes(b"x" * 4096)
    assert [os.path.basename(p) for p in vllm_shm_files(mine, str(tmp_path))] == names[:2]
    assert vllm_shm_files("7", str(tmp_path)) == []  # not a vllm_dist identity: matches nothing
    assert remove_vllm_shm(mine, str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])
    # a failed start: files new since the listing, unless a live process maps them (a running engine's)
    before = {names[3]}
    with open(tmp_path / names[2], "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert remove_orphaned_vllm_shm(before, str(tmp_path)) == 0  # mapped here: another engine's
    assert remove_orphaned_vllm_shm(before, str(tmp_path)) == 1  # unmapped now
    assert sorted(os.listdir(tmp_path)) == sorted([names[3], "dpcc-refit-1-x", f"{mine}.lock"])


def test_cpu_binding_puts_worker_w_on_rank_w_cores():
    from dpcc_megatron.rollout.vllm_engine import cpu_binding

    assert cpu_binding([[0, 1], [0, 1]]) == "0|1"  # unpinned ranks: one distinct core each
    assert cpu_binding([[2, 3], [0, 1]]) == "2,3|0,1"  # pinned ranks: their own cores
    assert cpu_binding([[0]]) == "0"


def test_vllm_tensor_parallel_size_is_validated_naming_the_key():
    from dpcc_megatron.config import ConfigError, load_config

    base = ["rollout.engine=vllm", "parallel.tensor_model_parallel_size=2", "model.num_attention_heads=4",
            "model.num_query_groups=2"]
    assert load_config(overrides=base).rollout.vllm.tensor_parallel_size is None  # default: TP x PP
    assert load_config(overrides=base + ["rollout.vllm.tensor_parallel_size=1"]).rollout.vllm.tensor_parallel_size == 1
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel_size.*must divide the model-parallel"):
        load_config(overrides=base + ["rollout.vllm.tensor_parallel_size=4"])
    # vLLM replicates K/V heads: W may be a multiple of the query groups, but must divide the heads
    assert load_config(overrides=base[:1] + ["parallel.tensor_model_parallel_size=4", "model.num_attention_heads=4",
                                             "model.num_query_groups=2"]).rollout.engine == "vllm"
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel_size.*num_attention_heads \(4\)"):
        load_config(overrides=base + ["parallel.pipeline_model_parallel_size=3", "model.num_layers=6"])
    for key, bad in (("refit_bucket_mb", 0), ("gpu_memory_utilization", 1.5), ("sleep_level", 3)):
        with pytest.raises(ConfigError, match=f"rollout.vllm.{key}"):
            load_config(overrides=[f"rollout.vllm.{key}={bad}"])


def test_untested_vllm_release_is_named():
    from dpcc_megatron.rollout.vllm_engine import untested_version

    assert untested_version("0.32.0") is None and untested_version("0.32.1+cpu") is None
    assert "rollout.vllm.allow_untested_version" in untested_version("0.40.0")


def test_the_engine_watcher_fails_loudly_without_the_internals_it_reads():
    from types import SimpleNamespace

    from dpcc_megatron.rollout.vllm_engine import dead_engine_processes

    with pytest.raises(EngineStartError, match="has no 'resources' there"):
        dead_engine_processes(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace())))


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


def test_bucket_plan_covers_every_tensor_once_and_never_splits_a_module():
    from dpcc_megatron.convert.layout import all_hf_shapes, units
    from dpcc_megatron.megatron.weight_export import module_of, plan_buckets
    from dpcc_megatron.testing.tiny import tiny_model_config

    cfg = tiny_model_config(num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                            num_query_groups=2, add_qkv_bias=True)
    stage = {u: (0 if u == "embedding" or (isinstance(u, int) and u < 2) else 1) for u in units(cfg)}
    plan = plan_buckets(cfg, 250, torch.float32, stage, 100_000)
    names = [n for b in plan for n, *_ in b.entries]
    import dataclasses

    assert names == [n for n, _ in all_hf_shapes(dataclasses.replace(cfg, vocab_size=250))]  # file order, once
    where = {}
    for b in plan:
        assert b.stage in (0, 1) and len({stage_of for stage_of in [b.stage]}) == 1
        ends = [o + nb for _, _, o, nb in b.entries]
        assert max(ends) <= b.nbytes
        for n, *_ in b.entries:
            where.setdefault(module_of(n), set()).add(b.index)
        # within the budget unless one module alone exceeds it
        if len({module_of(n) for n, *_ in b.entries}) > 1:
            assert b.nbytes <= 100_000
    assert all(len(v) == 1 for v in where.values())  # q/k/v (weights and biases) and gate/up stay together
    assert module_of("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv"
    assert module_of("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up"
