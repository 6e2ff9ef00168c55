"""Training checkpoints with ``megatron.core.dist_checkpointing`` (torch_dist).

Layout of ``checkpoint.dir``::

    latest                 text file: name of the newest complete checkpoint
    iter_0000010/          dist_checkpointing files (model + optimizer shards, common.pt, metadata.json)
        trainer_state.json iteration, DPCC controller, data position, reward state, config, layout
        rng/rank{r}.pt     each rank's RNG states
        rng/local{r}.pt    each rank's local trainer state (the reward model's), when given

Writes are atomic: everything goes to ``.tmp_iter_*`` and is renamed once complete,
then ``latest`` is replaced through a temporary file. Only the last ``keep_last``
checkpoints are kept. Resume requires the same model config and TP/PP/DP layout
(optimizer shards are layout-specific); anything else is refused with the difference.

Asynchronous saves (``checkpoint.async_save``): with an ``AsyncCallsQueue`` the shards are
written by a background process while training goes on; the finalisation (``trainer_state.json``,
the rename, the ``latest`` pointer and the removal of old checkpoints) runs only once every rank's
write has finished, when the trainer calls :func:`finalize_saves`. Until then ``latest`` names the
previous checkpoint, so a crash mid-write resumes from a complete one.

Old checkpoints are never deleted inside a barrier: rank 0 renames them to ``.trash_iter_*``
(one metadata operation) and a background thread deletes them while training continues;
leftovers of a killed process are swept by the next save.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


class CheckpointError(RuntimeError):
    pass


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not name or not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint")
    return path


def _sharded_state(chunks, optimizer, is_loading: bool, extra=None) -> dict:
    model_sd = {}
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        model_sd[key] = getattr(chunk, "module", chunk).sharded_state_dict()
    state = dict(model_sd)
    if optimizer is not None:
        # The optimizer finds each parameter's sharded tensor by identity anywhere in this nested
        # dict (as Megatron's own checkpointing passes model0, model1, ...); merging the chunks into
        # one dict would drop all but the last chunk's entries, whose local names collide.
        # dp_reshardable: the distributed optimizer's format that current megatron-core saves
        # (the older flattened-range default is refused by its torch_dist strategy).
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    if extra is not None:  # e.g. the frozen reference policy (keys carry their own prefix)
        state.update(extra.sharded_state_dict())
    return state


def rng_state() -> dict:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["tracker"] = get_cuda_rng_tracker().get_states()
    except Exception:
        pass
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root: str | Path, iteration: int, chunks, optimizer, scheduler, trainer_state: dict,
                    keep_last: int = 2, local_state: Optional[dict] = None, extra=None,
                    async_queue=None, protect: Optional[int] = None,
                    add_files: Optional[Callable[[Path], None]] = None) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path.

    ``local_state`` (this rank's, e.g. the reward state) is written inside the checkpoint before
    the rename, so a checkpoint named by ``latest`` always has it; read it back with
    :func:`load_local_state`. ``extra`` (an object with ``sharded_state_dict()`` and
    ``load_sharded(loaded)``, such as the reference policy) is saved in the same checkpoint. With
    ``async_queue`` (megatron-core's ``AsyncCallsQueue``) the shards are written in the background
    and the path does not exist until :func:`finalize_saves` has finalised the save; without it
    everything is done when this returns. ``protect``: also keep the newest checkpoint at or before
    this iteration and every later one (the monitor's rollback target; see
    :func:`retire_old_checkpoints`). Without an
    ``optimizer`` (the start of a run, before any step made Adam state) the checkpoint holds the
    weights, scheduler and trainer state; its ``trainer_state.json`` says ``optimizer_saved: false``
    and the loader then leaves the optimizer to the caller (a fresh one). ``add_files(dir)``: rank 0 writes
    files of its own into the checkpoint before it is complete (e.g. the source model's config and
    tokenizer, which exports read back)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    name = f"iter_{iteration:07d}"
    tmp, final = root / f".tmp_{name}", root / name
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # a save that never finished: deleted in the background like old checkpoints
            _to_trash(tmp)
        tmp.mkdir()
    _barrier()
    # Signals are held while saving: SIGUSR1/SIGTERM is what triggers this save under Slurm, and a
    # second one must not kill dist_checkpointing's helper process mid-write (it is re-delivered after).
    held = {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        request = dist_checkpointing.save(_sharded_state(chunks, optimizer, is_loading=False, extra=extra), str(tmp),
                                          **(_async_save_kwargs() if async_queue is not None else {}))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank{_rank()}.pt")
    if local_state is not None:
        torch.save(local_state, tmp / "rng" / f"local{_rank()}.pt")
    text = None
    if _rank() == 0 and add_files is not None:
        add_files(tmp)
    if _rank() == 0:  # serialised now: the trainer moves on before an asynchronous save finalises
        state = dict(trainer_state)
        state["iteration"] = iteration
        state["optimizer_saved"] = optimizer is not None
        state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        text = json.dumps(state, indent=1, default=_json_default)

    def finalize() -> None:  # on every rank, once every rank's shards are on disk
        if _rank() == 0:
            (tmp / "trainer_state.json").write_text(text)
            if final.exists():  # saved again after a rollback
                _to_trash(final)
            os.replace(tmp, final)
            pointer_tmp = root / ".latest.tmp"
            pointer_tmp.write_text(name + "\n")
            os.replace(pointer_tmp, root / "latest")
            retire_old_checkpoints(root, keep_last, protect=protect)
        _barrier()

    if request is None:
        _barrier()
        finalize()
    else:
        request.add_finalize_fn(finalize)
        signal.pthread_sigmask(signal.SIG_BLOCK, held)  # the writer process inherits the blocked mask
        try:
            async_queue.schedule_async_request(request)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
    return final


def remove_interrupted_saves(root: str | Path) -> list[str]:
    """Rank 0, at the start of a run: the ``.tmp_iter_*`` directories of saves that never finished
    (the process died mid-write) go to the trash and are deleted in the background, with any
    ``.trash_*`` a killed process left. Returns the names removed. Nothing of this run is in flight
    yet, so none of them can be a save still being written."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.glob(".tmp_iter_*") if p.is_dir())
    for p in stale:
        _to_trash(p)
    _delete_in_background(root)
    return [p.name for p in stale]


def load_local_state(path: str | Path) -> dict:
    """This rank's ``local_state`` of the checkpoint at ``path``; a missing or unreadable file is an
    error, never a silent fresh start (the saving run wrote one for every rank)."""
    f = Path(path) / "rng" / f"local{_rank()}.pt"
    if not f.is_file():
        raise CheckpointError(f"{f} is missing: the checkpoint lacks rank {_rank()}'s local state (reward model); "
                              "it is incomplete or was written by another layout")
    try:
        return torch.load(f, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
        raise CheckpointError(f"{f} is unreadable: {e}") from None


def async_save_unsupported() -> Optional[str]:
    """Why this megatron-core cannot save asynchronously, or None when it can."""
    import inspect

    try:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: F401
    except ImportError as e:
        return f"this megatron-core has no asynchronous checkpointing ({e})"
    if "async_sharded_save" not in inspect.signature(dist_checkpointing.save).parameters:
        return "this megatron-core's dist_checkpointing.save has no async_sharded_save"
    if not hasattr(get_default_save_sharded_strategy(), "async_save"):
        return "this megatron-core's torch_dist save strategy is not asynchronous"
    return None


def _async_save_kwargs() -> dict:
    """megatron-core >= 0.17 defaults to the NVIDIA Resiliency Extension's async writer ("nvrx");
    we pair its own ("mcore") writer with its own AsyncCallsQueue, as 0.16 always did."""
    import inspect

    from megatron.core import dist_checkpointing

    params = inspect.signature(dist_checkpointing.save).parameters
    return {"async_sharded_save": True, **({"async_strategy": "mcore"} if "async_strategy" in params else {})}


def make_async_queue(setting, *, cuda: Optional[bool] = None):
    """An ``AsyncCallsQueue`` when ``checkpoint.async_save`` resolves to on, else None.

    ``auto`` is on with CUDA and off on CPU; an explicit ``true`` that this megatron-core cannot do
    raises ``ConfigError`` naming the key."""
    from ..config import ConfigError

    if setting is False:
        return None
    cuda = torch.cuda.is_available() if cuda is None else cuda
    why = async_save_unsupported()
    if setting is True and why:
        raise ConfigError(f"checkpoint.async_save is true but {why}; set it to auto or false")
    if setting == "auto" and (why or not cuda):
        return None
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue()


def finalize_saves(async_queue, blocking: bool = False) -> list[int]:
    """Collective. Finalise the asynchronous saves whose writes finished on every rank (all of them
    with ``blocking``): trainer state, rename, ``latest``, old-checkpoint removal. Returns the
    finalised call indices; a no-op without a queue."""
    if async_queue is None:
        return []
    return async_queue.maybe_finalize_async_calls(blocking=blocking)


_deleters: list[threading.Thread] = []


def retire_old_checkpoints(root: Path, keep_last: int, protect: Optional[int] = None) -> list[Path]:
    """Rank 0: keep the newest ``keep_last`` complete checkpoints, and with ``protect`` also the
    newest one at or before that iteration and every one after it (the rollback target may be older
    than the last ``keep_last``, and it moves forward as the run stays healthy: the checkpoints it
    moves to must still exist; when none is at or before it, all are kept). Rename the others to
    ``.trash_<name>`` (cheap, atomic) and delete every ``.trash_*`` in a background thread, so no
    rank waits on ``rmtree`` of a large checkpoint. Returns the renamed paths."""
    root = Path(root)
    done = sorted(p for p in root.glob("iter_*") if p.is_dir())
    keep = set(done[-keep_last:])
    if protect is not None:
        at_or_before = [p for p in done if 0 <= _iteration_of(p) <= protect]
        # none at or before it (after a rollback the target can move back): every one is nearer than none
        floor = _iteration_of(at_or_before[-1]) if at_or_before else -1
        keep.update(p for p in done if _iteration_of(p) >= floor)
    retired = [_to_trash(old) for old in done if old not in keep]
    _delete_in_background(root)
    return retired


def retire_newer_than(root: Path, iteration: int) -> list[Path]:
    """Rank 0, after a rollback to ``iteration``: retire the checkpoints of the abandoned branch
    (those after it). Left in place they would count as the newest for ``keep_last`` (so the new
    branch's saves would be retired first) and could be chosen by a later rollback. ``latest``
    names the checkpoint rolled back to, so a run killed before its next save resumes there."""
    root = Path(root)
    newer = sorted(p for p in root.glob("iter_*") if p.is_dir() and _iteration_of(p) > iteration)
    retired = [_to_trash(p) for p in newer]
    name = f"iter_{iteration:07d}"
    if retired and (root / name).is_dir():
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / "latest")
    _delete_in_background(root)
    return retired


def _iteration_of(path: Path) -> int:
    """The iteration in a checkpoint directory's name (``iter_0000012`` -> 12; -1 for other names)."""
    digits = path.name[len("iter_"):]
    return int(digits) if digits.isdigit() else -1


def _delete_in_background(root: Path) -> None:
    leftovers = sorted(root.glob(".trash_*"))
    if leftovers:
        t = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in leftovers],
                             name="dpcc-checkpoint-delete", daemon=True)
        t.start()
        _deleters.append(t)


def _to_trash(path: Path) -> Path:
    """Rename ``path`` to a unique ``.trash_<name>.<ns>`` beside it (a metadata operation)."""
    import time

    trash = path.parent / f".trash_{path.name.lstrip('.')}.{time.time_ns()}"
    os.replace(path, trash)
    return trash


def wait_for_deletions(timeout: Optional[float] = None) -> None:
    """Join the background deletions started by this process (tests; the end of a run)."""
    while _deleters:
        _deleters.pop().join(timeout)


def _json_default(obj: Any):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in trainer_state.json")


def check_compatible(saved: dict, current: dict) -> None:
    """Refuse a checkpoint whose model config or layout differs; name every difference."""
    diffs = []
    for section in ("model", "layout"):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{section}.{key}: checkpoint has {a.get(key)!r}, this run has {b.get(key)!r}")
    if diffs:
        raise CheckpointError("checkpoint is incompatible with this run:\n  " + "\n  ".join(diffs))


def _materialise_optimizer_state(optimizer) -> None:
    """A fresh distributed optimizer has no Adam state to load into (without apex/TE its
    ``state_dict`` even asserts on it): create placeholder state; the load overwrites it."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        inner = getattr(opt, "optimizer", None)
        if init is not None and inner is not None and not any(len(v) for v in inner.state.values()):
            with torch.no_grad():
                init()


def _unshare_step_counters(optimizer) -> None:
    """Without apex/TE the distributed optimizer restores Adam's ``step`` as ONE tensor shared by
    every parameter, so each later step would add the parameter count to it (bias correction
    drifts). Give every parameter its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()


def load_checkpoint(path: str | Path, chunks, optimizer, scheduler, current: dict, extra=None) -> dict:
    """Collective. Loads weights, optimizer, scheduler, RNG and ``extra``; returns the trainer state.
    A checkpoint saved without optimizer state (``optimizer_saved: false``) leaves ``optimizer`` as it
    is: build a fresh one after this call, from the loaded weights."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/trainer_state.json is unreadable: {e}") from None
    check_compatible(state, current)
    if state.get("optimizer_saved") is False:  # saved before any step: the caller builds a fresh optimizer
        optimizer = None
    if optimizer is not None:
        _materialise_optimizer_state(optimizer)
    sharded = _sharded_state(chunks, optimizer, is_loading=True, extra=extra)
    loaded = dist_checkpointing.load(sharded, str(path))
    if extra is not None:
        extra.load_sharded(loaded)
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        getattr(chunk, "module", chunk).load_state_dict(loaded[key])
    if optimizer is not None:
        with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_step_counters(optimizer)
    if scheduler is not None and state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])
    rng = path / "rng" / f"rank{_rank()}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return state
