"""Checkpoints: a save/load round trip with the distributed optimizer at DP=2, and at PP2 x VPP2
(two model chunks per rank, one sharded state dict each) x DP2, continues exactly,
writes are atomic with a `latest` pointer, and an incompatible checkpoint is refused."""
import json
from pathlib import Path

import pytest
import torch

from dpcc_megatron.megatron.checkpoint import CheckpointError, check_compatible, latest_checkpoint
from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config


def _step(chunks, opt, seed):
    g = torch.Generator().manual_seed(seed)
    for c in chunks:
        for p in c.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
    opt.step()


def _round_trip_rank(rank, world, root, pp=1, vpp=None):
    from dpcc_megatron.config import OptimizerConfig, PrecisionConfig
    from dpcc_megatron.megatron.checkpoint import load_checkpoint, save_checkpoint
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors

    par = parallel_config(1, pp, use_distributed_optimizer=True, virtual_pipeline_model_parallel_size=vpp)
    init_model_parallel(par, seed=1)
    optim = OptimizerConfig(lr=1e-2)

    def fresh(seed):
        torch.manual_seed(seed)
        chunks = build_training_model(tiny_model_config(num_layers=2 * pp * (vpp or 1)), par, PrecisionConfig())
        assert len(chunks) == (vpp or 1)
        opt = build_optimizer(chunks, optim, par, PrecisionConfig())
        return chunks, opt, build_scheduler(opt, optim, total_steps=10)

    chunks, opt, sched = fresh(0)
    _step(chunks, opt, 1)
    sched.step(1)
    meta = {"model": {"h": 64}, "layout": {"dp": world}}
    save_checkpoint(root, 1, chunks, opt, sched, dict(meta, note="x"), keep_last=1)
    _step(chunks, opt, 2)  # the reference continues without reloading
    expected = local_named_tensors(chunks)

    chunks2, opt2, sched2 = fresh(99)  # different init: everything must come from the checkpoint
    state = load_checkpoint(latest_checkpoint(root), chunks2, opt2, sched2, meta)
    _step(chunks2, opt2, 2)
    got = local_named_tensors(chunks2)
    return state["iteration"], state["note"], max(float((expected[k] - got[k]).abs().max()) for k in expected)


@pytest.mark.multirank
@pytest.mark.parametrize("pp,vpp", [(1, None), (2, 2)], ids=["dp2", "pp2vpp2dp2"])
def test_distributed_optimizer_round_trip_continues_exactly(tmp_path, pp, vpp):
    results = run_multirank(_round_trip_rank, 2 * pp, args=(str(tmp_path / "ck"), pp, vpp), timeout=300)
    for iteration, note, diff in results:
        assert iteration == 1 and note == "x"
        assert diff == 0.0  # Adam moments, step count and weights all restored
    assert (tmp_path / "ck" / "latest").read_text().strip() == "iter_0000001"
    assert not list((tmp_path / "ck").glob(".tmp_*"))


def _weights_only_rank(rank, world, root):
    from dpcc_megatron.config import OptimizerConfig, PrecisionConfig
    from dpcc_megatron.megatron.checkpoint import load_checkpoint, save_checkpoint
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors

    par = parallel_config(1, 1, use_distributed_optimizer=True)
    init_model_parallel(par, seed=1)
    optim = OptimizerConfig(lr=1e-2)
    torch.manual_seed(0)
    chunks = build_training_model(tiny_model_config(num_layers=2), par, PrecisionConfig())
    opt = build_optimizer(chunks, optim, par, PrecisionConfig())
    sched = build_scheduler(opt, optim, total_steps=10)
    meta = {"model": {"h": 64}, "layout": {"dp": world}}
    save_checkpoint(root, 0, chunks, None, sched, dict(meta), keep_last=1)  # the start: no Adam state yet
    _step(chunks, opt, 2)
    expected = local_named_tensors(chunks)

    torch.manual_seed(99)  # another run that has stepped: its weights and Adam state must not survive
    chunks2 = build_training_model(tiny_model_config(num_layers=2), par, PrecisionConfig())
    opt2 = build_optimizer(chunks2, optim, par, PrecisionConfig())
    _step(chunks2, opt2, 5)
    state = load_checkpoint(latest_checkpoint(root), chunks2, opt2, build_scheduler(opt2, optim, 10), meta)
    opt3 = build_optimizer(chunks2, optim, par, PrecisionConfig())  # what the trainer does after it
    _step(chunks2, opt3, 2)
    got = local_named_tensors(chunks2)
    return state["optimizer_saved"], max(float((expected[k] - got[k]).abs().max()) for k in expected)


@pytest.mark.multirank
def test_a_weights_only_start_checkpoint_loads_and_continues_with_a_fresh_optimizer(tmp_path):
    for saved, diff in run_multirank(_weights_only_rank, 2, args=(str(tmp_path / "ck"),), timeout=300):
        assert saved is False
        assert diff == 0.0


def test_incompatible_checkpoint_names_every_difference():
    saved = {"model": {"hidden_size": 64, "num_layers": 2}, "layout": {"tensor_model_parallel_size": 2}}
    current = {"model": {"hidden_size": 128, "num_layers": 2}, "layout": {"tensor_model_parallel_size": 1}}
    with pytest.raises(CheckpointError) as info:
        check_compatible(saved, current)
    msg = str(info.value)
    assert "model.hidden_size: checkpoint has 64, this run has 128" in msg
    assert "layout.tensor_model_parallel_size" in msg and "num_layers" not in msg


def test_latest_pointer_to_an_incomplete_checkpoint_is_an_error(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "iter_0000003").mkdir()
    (tmp_path / "latest").write_text("iter_0000003\n")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        latest_checkpoint(tmp_path)
    (tmp_path / "iter_0000003" / "trainer_state.json").write_text(json.dumps({"iteration": 3}))
    assert latest_checkpoint(tmp_path).name == "iter_0000003"


def _async_rank(rank, world, root):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from dpcc_megatron.config import OptimizerConfig, PrecisionConfig
    from dpcc_megatron.megatron.checkpoint import (finalize_saves, load_checkpoint, save_checkpoint,
                                                   wait_for_deletions)
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors

    par = parallel_config(1, 1, use_distributed_optimizer=True)
    init_model_parallel(par, seed=1)
    optim = OptimizerConfig(lr=1e-2)

    def fresh(seed):
        torch.manual_seed(seed)
        chunks = build_training_model(tiny_model_config(num_layers=2), par, PrecisionConfig())
        return chunks, build_optimizer(chunks, optim, par, PrecisionConfig())

    chunks, opt = fresh(0)
    queue = AsyncCallsQueue()
    meta = {"model": {"h": 64}, "layout": {"dp": world}}
    seen = []
    for it in (1, 2):
        _step(chunks, opt, it)
        save_checkpoint(root, it, chunks, opt, None, meta, keep_last=1, local_state={"r": rank}, async_queue=queue)
        pointer = Path(root) / "latest"
        seen.append(pointer.read_text().strip() if pointer.exists() else None)  # before finalisation
        assert finalize_saves(queue, blocking=True) == [it - 1]
        seen.append(pointer.read_text().strip())
    expected = local_named_tensors(chunks)
    wait_for_deletions()
    chunks2, opt2 = fresh(99)
    _step(chunks2, opt2, 7)  # the optimizer needs state of its own before a load
    state = load_checkpoint(Path(root) / "iter_0000002", chunks2, opt2, None, meta)
    got = local_named_tensors(chunks2)
    local = torch.load(Path(root) / "iter_0000002" / "rng" / f"local{rank}.pt")
    return seen, state["iteration"], max(float((expected[k] - got[k]).abs().max()) for k in expected), local


@pytest.mark.multirank
def test_async_save_updates_latest_and_removes_old_only_after_finalising(tmp_path):
    root = tmp_path / "ck"
    results = run_multirank(_async_rank, 2, args=(str(root),), timeout=300)
    for rank, (seen, iteration, diff, local) in enumerate(results):
        # `latest` names the previous checkpoint until every rank's write has been finalised.
        assert seen == [None, "iter_0000001", "iter_0000001", "iter_0000002"]
        assert iteration == 2 and diff == 0.0 and local == {"r": rank}
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "latest"]  # iter 1 retired and deleted


def test_old_checkpoints_are_renamed_then_deleted_in_the_background(tmp_path, monkeypatch):
    import threading

    import dpcc_megatron.megatron.checkpoint as ck

    for i in (1, 2, 3):
        (tmp_path / f"iter_{i:07d}").mkdir()
        (tmp_path / f"iter_{i:07d}" / "shard").write_bytes(b"x" * 10)
    (tmp_path / ".trash_iter_0000000").mkdir()  # left by a process killed mid-deletion
    release = threading.Event()
    real = ck.shutil.rmtree
    monkeypatch.setattr(ck.shutil, "rmtree", lambda p, **kw: (release.wait(10), real(p, **kw)))
    retired = ck.retire_old_checkpoints(tmp_path, keep_last=1)
    # Returned before any deletion ran: the caller (rank 0, outside every barrier) never waits on rmtree.
    assert [p.name.split(".")[1] for p in retired] == ["trash_iter_0000001", "trash_iter_0000002"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003"]
    assert len(list(tmp_path.glob(".trash_*"))) == 3
    release.set()
    ck.wait_for_deletions(10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003"]


def _fake_checkpoints(root, iterations):
    for i in iterations:
        (root / f"iter_{i:07d}").mkdir()


def test_retention_keeps_the_rollback_target_beyond_keep_last(tmp_path):
    import dpcc_megatron.megatron.checkpoint as ck

    _fake_checkpoints(tmp_path, (0, 2, 3, 4, 5))
    ck.retire_old_checkpoints(tmp_path, keep_last=2, protect=1)
    # the newest at or before the target, and every later one (the target moves forward to them)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [f"iter_000000{i}" for i in (0, 2, 3, 4, 5)]
    ck.retire_old_checkpoints(tmp_path, keep_last=2, protect=3)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000004", "iter_0000005"]
    # after a rollback the target can move back before every kept checkpoint: all of them stay
    ck.retire_old_checkpoints(tmp_path, keep_last=1, protect=1)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000004", "iter_0000005"]
    ck.retire_old_checkpoints(tmp_path, keep_last=2)  # nothing to protect: keep_last alone
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000005"]
    ck.wait_for_deletions(10)


def test_a_healthy_run_that_saves_every_iteration_always_has_a_checkpoint_for_the_next_rollback(tmp_path):
    """The trainer's sequence: save iter_i after record i-1, retention with the moving target; any
    confirmed alert at the next record, whose evidence spans up to the detector's window, finds a
    kept checkpoint at or before its rollback target, and the disk holds only a few."""
    import dpcc_megatron.megatron.checkpoint as ck
    from dpcc_megatron.config import MonitorConfig
    from dpcc_megatron.monitor.alerts import rollback_target
    from dpcc_megatron.monitor.detector import CollapseDetector
    from dpcc_megatron.train.control import retention_target

    cfg = MonitorConfig()
    w = CollapseDetector(cfg).evidence_window
    assert w == 3  # the shipped rules' longest critical window
    _fake_checkpoints(tmp_path, (0,))  # the start
    for i in range(1, 32):
        (tmp_path / f"iter_{i:07d}").mkdir()
        ck.retire_old_checkpoints(tmp_path, keep_last=2, protect=retention_target(i - 1, w, cfg))
        kept = [int(p.name[5:]) for p in tmp_path.glob("iter_*")]
        assert len(kept) <= w + 3
        window = [[j, 0.0] for j in range(max(0, i - w + 1), i + 1)]  # an alert at record i
        target = rollback_target(i - 1, window)
        goal = 0 if target is None else target
        # the rollback lands on its target itself, not on some older survivor such as the start
        assert max(k for k in kept if k <= goal) == goal, (i, target, sorted(kept))
    # a collapse confirmed at record 31 (evidence 29-31): back to 28, whose detector state has 27 as
    # its last healthy iteration; the re-run records 28-30 confirm again (evidence 28-30): back to 27
    assert rollback_target(30, [[29, 0], [30, 0], [31, 0]]) == 28
    ck.retire_newer_than(tmp_path, 28)
    for i in (29, 30):  # saved again on the new branch, the restored last healthy iteration being 27
        (tmp_path / f"iter_{i:07d}").mkdir()
        ck.retire_old_checkpoints(tmp_path, keep_last=2, protect=retention_target(27, w, cfg))
    kept = [int(p.name[5:]) for p in tmp_path.glob("iter_*")]
    assert 27 in kept, sorted(kept)
    ck.wait_for_deletions(10)


def test_rollback_retires_the_abandoned_branch_and_repoints_latest(tmp_path):
    import dpcc_megatron.megatron.checkpoint as ck

    _fake_checkpoints(tmp_path, (2, 4, 5, 6))
    (tmp_path / "latest").write_text("iter_0000006\n")
    ck.retire_newer_than(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002"]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    # the new branch's next save is then among the newest, not retired at once
    _fake_checkpoints(tmp_path, (3,))
    ck.retire_old_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003"]
    ck.wait_for_deletions(10)


def test_async_save_setting_resolves_per_hardware_and_refuses_what_cannot_run(monkeypatch):
    import dpcc_megatron.megatron.checkpoint as ck
    from dpcc_megatron.config import ConfigError

    assert ck.make_async_queue(False, cuda=True) is None
    assert ck.make_async_queue("auto", cuda=False) is None  # CPU: synchronous by default
    assert ck.make_async_queue("auto", cuda=True) is not None
    assert ck.make_async_queue(True, cuda=False) is not None  # asked for, and this megatron-core can
    monkeypatch.setattr(ck, "async_save_unsupported", lambda: "no AsyncCallsQueue here")
    assert ck.make_async_queue("auto", cuda=True) is None
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save is true but no AsyncCallsQueue here"):
        ck.make_async_queue(True, cuda=True)
