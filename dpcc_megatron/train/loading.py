"""What the trainer says while it loads weights: which checkpoint, what it holds, how far it got.

    with loading("resuming from", path, describe_checkpoint(path), job_layout(ctx), log=ctx.log0):
        load_checkpoint(...)

prints, on rank 0, one line naming the checkpoint (its kind, iteration and layout) and the job's
layout, a line every ``interval_s`` seconds while the load runs (elapsed time and the bytes this
process has read, from ``/proc/self/io``), and the time it took. Loads of a 70B checkpoint take
minutes; nothing else is printed meanwhile.

Also here: the run identity a training checkpoint records (``trainer_state.json`` ``run``), with
which a run that starts into a ``checkpoint.dir`` holding a later or unrelated run says so.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

GIB = float(1 << 30)
PROGRESS_INTERVAL_S = 30.0


def layout_text(layout: Optional[dict]) -> str:
    """``TP8 PP2 VPP5 DP4, distributed optimizer`` from a checkpoint's (or this job's) layout dict."""
    if not layout:
        return "layout not recorded"
    vpp = layout.get("virtual_pipeline_model_parallel_size")
    text = (f"TP{layout.get('tensor_model_parallel_size')} PP{layout.get('pipeline_model_parallel_size')}"
            + (f" VPP{vpp}" if vpp else "") + f" DP{layout.get('data_parallel_size')}")
    if "use_distributed_optimizer" in layout:
        text += ", distributed optimizer" if layout["use_distributed_optimizer"] else ", no distributed optimizer"
    return text


def _disk_gib(path: Path) -> float:
    try:
        return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / GIB
    except OSError:
        return float("nan")


def describe_checkpoint(path: str | Path) -> str:
    """One phrase for a training checkpoint (iteration, layout), a converted checkpoint (its source)
    or a NeMo 2 checkpoint, with its size on disk."""
    path = Path(path)
    size = f"{_disk_gib(path):.1f} GiB on disk"
    state_file = path / "trainer_state.json"
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            return f"a training checkpoint whose trainer_state.json is unreadable ({e})"
        opt = "" if state.get("optimizer_saved", True) else ", weights and schedule only"
        return (f"training checkpoint of iteration {state.get('iteration')}, saved at "
                f"{layout_text(state.get('layout'))}{opt}; {size}")
    from ..convert.mcore_format import MODEL_FILE
    from ..convert.nemo_format import is_nemo2_dir

    if is_nemo2_dir(path):
        return f"NeMo 2 checkpoint (resharded to this job's layout as it loads); {size}"
    if (path / MODEL_FILE).is_file():
        import yaml

        try:
            doc = yaml.safe_load((path / MODEL_FILE).read_text()) or {}
        except yaml.YAMLError:
            doc = {}
        src = doc.get("source") or {}
        made = src.get("converted_for") or {}
        origin = f" of {src.get('architecture')} from {src.get('path')}" if src.get("path") else ""
        return (f"converted checkpoint{origin}, stored {doc.get('dtype')}, written for TP{made.get('tp', 1)} "
                f"PP{made.get('pp', 1)} (any layout loads it); {size}")
    return f"Megatron-Core checkpoint; {size}"


def job_layout(cfg, dp: int) -> str:
    p = cfg.parallel
    return layout_text({"tensor_model_parallel_size": p.tensor_model_parallel_size,
                        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                        "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
                        "data_parallel_size": dp, "use_distributed_optimizer": p.use_distributed_optimizer})


def _bytes_read() -> Optional[int]:
    """Bytes this process has passed through read(2) and the like (``rchar``), or None off Linux."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@contextmanager
def loading(what: str, path, description: str, job: str, log: Optional[Callable[[str], None]],
            interval_s: float = PROGRESS_INTERVAL_S):
    """Announce a load, report progress every ``interval_s`` while the block runs, then its time.
    ``log`` None (ranks other than 0) says nothing."""
    if log is None:
        yield
        return
    log(f"[dpcc] {what} {path}: {description}; this job: {job}")
    start, read0 = time.monotonic(), _bytes_read()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(interval_s):
            now = _bytes_read()
            got = "" if now is None or read0 is None else f", this rank has read {(now - read0) / GIB:.1f} GiB"
            log(f"[dpcc] still loading {path} ({time.monotonic() - start:.0f} s{got})")

    t = threading.Thread(target=beat, name="dpcc-load-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
    log(f"[dpcc] loaded {path} in {time.monotonic() - start:.1f} s")


def announce(what: str, path, cfg, dp: int, rank: int):
    """:func:`loading` for ``path`` as this job sees it: rank 0 names what it holds and the job's layout;
    other ranks say nothing. A training-checkpoint root is described by the checkpoint ``latest`` names."""
    if rank != 0:
        return loading(what, path, "", "", None)
    shown = Path(path)
    try:
        from ..convert.mcore_format import resolve_checkpoint_dir
        from ..convert.nemo_format import is_nemo2_dir

        if not is_nemo2_dir(shown):
            shown = resolve_checkpoint_dir(shown)
    except Exception:  # noqa: BLE001 - the load itself reports what is wrong with the path
        pass
    return loading(what, shown, describe_checkpoint(shown), job_layout(cfg, dp), lambda m: print(m, flush=True))


# -- run identity --------------------------------------------------------------------------------
def model_fingerprint(model: dict) -> str:
    """A short hash of the model config (architecture and sizes): two runs with different ones cannot
    share checkpoints."""
    return hashlib.sha256(json.dumps(model, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_identity(cfg) -> dict:
    """What a training checkpoint records about the run that wrote it (``trainer_state.json`` ``run``)."""
    from ..config import to_dict

    return {"model_fingerprint": model_fingerprint(to_dict(cfg.model)), "init": cfg.checkpoint.load,
            "seed": cfg.train.seed, "data": cfg.data.prompts}


def identity_problems(saved: dict, cfg) -> tuple[list[str], list[str]]:
    """(errors, notes) comparing a checkpoint's trainer state with this run.

    Errors: the checkpoint is of an unrelated run (another model config: fingerprint) or of a later
    one (its iteration is past this run's ``train.iterations``). Notes: it is of the same model but
    was started from other weights, or with another seed or data file (resuming continues it, with
    this config's other settings)."""
    errors, notes = [], []
    here = run_identity(cfg)
    theirs = saved.get("run") or {}
    fp = theirs.get("model_fingerprint")
    if fp is not None and fp != here["model_fingerprint"]:
        errors.append(f"it holds an unrelated run: its model config (fingerprint {fp}) is not this run's "
                      f"({here['model_fingerprint']})")
    it = saved.get("iteration")
    if isinstance(it, int) and it > cfg.train.iterations:
        errors.append(f"it holds a later run: iteration {it}, past this run's train.iterations="
                      f"{cfg.train.iterations} (raise train.iterations to go on)")
    for key, name in (("init", "checkpoint.load"), ("seed", "train.seed"), ("data", "data.prompts")):
        if key in theirs and theirs[key] != here[key]:
            notes.append(f"the checkpoint's run had {name}={theirs[key]!r}, this config has {here[key]!r}")
    return errors, notes
