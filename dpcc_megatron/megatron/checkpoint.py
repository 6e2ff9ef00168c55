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
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Optional

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


def _rng_state() -> dict:
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


def _set_rng_state(state: dict) -> None:
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
                    keep_last: int = 2, local_state: Optional[dict] = None, extra=None) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path.

    ``local_state`` (this rank's, e.g. the reward state) is written inside the checkpoint before
    the atomic rename, so a checkpoint named by ``latest`` always has it; read it back with
    :func:`load_local_state`. ``extra`` (an object with ``sharded_state_dict()`` and
    ``load_sharded(loaded)``, such as the reference policy) is saved in the same checkpoint."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    name = f"iter_{iteration:07d}"
    tmp, final = root / f".tmp_{name}", root / name
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    # Signals are held while saving: SIGUSR1/SIGTERM is what triggers this save under Slurm, and a
    # second one must not kill dist_checkpointing's helper process mid-write (it is re-delivered after).
    held = {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        dist_checkpointing.save(_sharded_state(chunks, optimizer, is_loading=False, extra=extra), str(tmp))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{_rank()}.pt")
    if local_state is not None:
        torch.save(local_state, tmp / "rng" / f"local{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        state = dict(trainer_state)
        state["iteration"] = iteration
        state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, default=_json_default))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / "latest")
        done = sorted(p for p in root.glob("iter_*") if p.is_dir())
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


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
    """Collective. Loads weights, optimizer, scheduler, RNG and ``extra``; returns the trainer state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/trainer_state.json is unreadable: {e}") from None
    check_compatible(state, current)
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
        _set_rng_state(torch.load(rng, weights_only=False))
    return state
