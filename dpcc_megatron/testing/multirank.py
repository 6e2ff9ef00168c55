"""Run a function on N torch.distributed ranks (gloo, CPU), each in its own process.

    results = run_multirank(my_fn, world_size=2, args=(cfg,), timeout=120)

``my_fn(rank, world_size, *args)`` must be importable (module level). Each rank
initialises gloo, switches on the CPU execution layer and calls it; return values
come back through files (no pipe deadlocks on large results). A rank that raises
makes the whole call raise :class:`RankFailure` with that rank's traceback; a rank
that is still running at the deadline is killed, so a hung collective can never
hang CI.

Ranks are forked from a ``forkserver`` that imports torch, Megatron-Core and the trainer once
per calling process; a spawned interpreter re-imports them for every rank (seconds per rank,
up to a minute on a loaded machine). Each rank is still a fresh process with the caller's
current environment, working directory, ``sys.path`` and stdout/stderr: nothing one call's
ranks change reaches the next call's. For the same reason each rank forks the helper process that
``dist_checkpointing`` would spawn on its first save (see :func:`_fork_checkpoint_results_queue`).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence


class RankFailure(RuntimeError):
    """One or more ranks failed or timed out; the message holds their tracebacks."""


# Imported once by the fork server (best effort: a module that fails to import is skipped there
# and imported by the rank itself): what a rank of the trainer imports, and pytest, which every test
# module does. They fix at import nothing a test sets in the environment (transformers reads HF_*: left out).
_PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt.gpt_layer_specs",
            "megatron.core.dist_checkpointing.strategies.torch", "dpcc_megatron.train.trainer",
            "dpcc_megatron.megatron.checkpoint", "dpcc_megatron.rewards", "pytest")


_server_started = False


def _noop() -> None:
    pass


def _context():
    global _server_started
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # read when the server starts (the first call)
    if not _server_started:
        # Start the server and let it finish its imports before a port is picked: a port that stays
        # unused for the whole start-up can be taken by another process meanwhile.
        p = ctx.Process(target=_noop, name="forkserver-warmup")
        p.start()
        p.join()
        _server_started = True
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CallerStdio:
    """The caller's stdout and stderr as they are at the launch (pytest's capture of the current test, a log
    file): forked ranks would otherwise write to the fork server's, which it inherited when it started."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _attach_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _attach_stdio(out, err) -> None:
    for wrapped, target in ((out, 1), (err, 2)):
        fd = wrapped.detach()
        os.dup2(fd, target)
        os.close(fd)


def _rank_main(fn, rank, world_size, port, args, out_dir, env, timeout, _stdio=None):
    # _stdio: a _CallerStdio, already attached while the arguments were unpickled
    # Its own process group: stopping a rank also stops what it started (see _kill).
    os.setpgrp()
    # The fork server's environment is the one it started with: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from .cpu_layer import enable_cpu_megatron

        torch.set_num_threads(1)  # N ranks share few cores; oversubscription slows gloo badly
        enable_cpu_megatron()
        _fork_checkpoint_results_queue()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        # Every rank has finished connecting before any can return and close its connections: a
        # rank whose function returns at once would otherwise make a slower peer's connect fail.
        dist.barrier()
        try:
            result = fn(rank, world_size, *args)
        finally:
            try:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            except Exception:
                pass
            dist.destroy_process_group()
        payload = ("ok", result)
    except BaseException:  # report everything, including SystemExit from the test body
        payload = ("error", traceback.format_exc())
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, out)
    if payload[0] == "error":
        out.with_suffix(".err").touch()  # cheap marker the parent polls for


def _fork_checkpoint_results_queue() -> None:
    """Megatron-Core's ``dist_checkpointing`` passes write results through a ``multiprocessing``
    Manager that it spawns on a process's first save: a fresh interpreter that imports torch to
    unpickle them (seconds per rank). A rank here forks it instead, from a process that already has
    torch, before any thread of gloo exists; SIGUSR1/SIGTERM/SIGINT are held while it starts, as
    ``megatron/checkpoint.save_checkpoint`` holds them around the spawn. Everything else about the
    save is unchanged (a second save in any process takes this same cached-queue path)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if not hasattr(filesystem_async, "_results_queue") or filesystem_async._results_queue is not None:
        return
    held = {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def run_multirank(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                  timeout: float = 180.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = _context()
    port = free_port()
    rank_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="dpcc-ranks-") as out_dir:
        procs = [ctx.Process(target=_rank_main, daemon=False, name=f"rank{r}",
                             args=(fn, r, world_size, port, tuple(args), out_dir, rank_env, timeout,
                                   _CallerStdio()))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure_at = None
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                failed = any(p.exitcode not in (None, 0) for p in procs) or any(
                    _is_error(Path(out_dir) / f"rank{r}.pkl") for r in range(world_size))
                if failed and first_failure_at is None:
                    first_failure_at = now
                # Once one rank fails, its peers will block in a collective: give them a moment, then stop.
                if now > deadline or (first_failure_at is not None and now - first_failure_at > 10):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    _kill(p)
            for p in procs:
                p.join(5)

        results, errors = [], []
        for r, p in enumerate(procs):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                why = "timed out" if time.monotonic() > deadline else f"exited with code {p.exitcode}"
                errors.append(f"--- rank {r}: {why} without a result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"--- rank {r} raised:\n{value}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(errors))
        return results


def _kill(p) -> None:
    """SIGKILL the rank and its process group: helpers it started (the checkpoint helper, which holds
    SIGTERM blocked) would otherwise outlive it, and keep the fork server alive too."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not yet in its own group, or already gone
        pass
    p.kill()


def _is_error(path: Path) -> bool:
    return path.with_suffix(".err").exists()
