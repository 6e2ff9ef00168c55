"""Run untrusted Python in a resource-limited subprocess (never in the trainer process).

Each run gets a fresh temporary working directory, an almost empty environment,
``python -I`` (isolated mode: no user site, no cwd on sys.path, PYTHON* env
ignored) and its own session, so a timeout kills the whole process group. A
boot prelude, executed before any untrusted byte is read, sets hard rlimits
(address space, CPU time, file size, no new processes, no core dumps) and
replaces the socket and process-spawning APIs with functions that raise.

Why a prelude instead of ``preexec_fn``: checkers run sandboxes from a thread
pool, and Python documents ``preexec_fn`` as unsafe in threaded programs (the
forked child can deadlock before exec). The prelude runs in the child before
the payload, so the payload sees the same hard limits.

Limits of this sandbox (be explicit): when the trainer runs as root,
RLIMIT_NPROC is not enforced by the kernel and hard limits can be raised again,
and the socket patch is a Python-level guard. On shared clusters run the
workers unprivileged and put real isolation (network/PID/mount namespaces,
e.g. bubblewrap, nsjail or a container with ``--network none``) around them.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping, Optional

_OUTPUT_TAIL = 64 * 1024

_BOOT = r'''
import os, resource, sys

def _limit(res, value, hard=None):
    try:
        resource.setrlimit(res, (value, value if hard is None else hard))
    except (ValueError, OSError):
        pass

_limit(resource.RLIMIT_AS, {memory})
_limit(resource.RLIMIT_CPU, {cpu}, {cpu} + 1)  # SIGXCPU first, SIGKILL a second later
_limit(resource.RLIMIT_FSIZE, {fsize})
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_NPROC, 0)  # no fork bombs (not enforced for root)

def _blocked(*args, **kwargs):
    raise PermissionError("blocked in the dpcc reward sandbox")

import socket, _socket
for _mod in (socket, _socket):
    for _name in ("socket", "create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
        if hasattr(_mod, _name):
            setattr(_mod, _name, _blocked)
for _name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "kill", "killpg",
              "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
              "spawnv", "spawnve", "spawnl", "spawnle", "spawnvp", "spawnvpe", "spawnlp", "spawnlpe"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
import _posixsubprocess
_posixsubprocess.fork_exec = _blocked
del _limit, _mod, _name, socket, _socket, _posixsubprocess

with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code, {{"__name__": "__main__", "__builtins__": __builtins__}})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits; see :class:`dpcc_megatron.config.reward.SandboxConfig`."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    cpu_s: int = 0
    file_size_mb: int = 16
    python: str = sys.executable

    @classmethod
    def from_config(cls, cfg) -> "SandboxLimits":
        return cls(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, cpu_s=cfg.cpu_s, file_size_mb=cfg.file_size_mb)

    @property
    def cpu_limit_s(self) -> int:
        return self.cpu_s or int(math.ceil(self.timeout_s)) + 1


@dataclass
class SandboxResult:
    returncode: Optional[int]
    """Exit status; negative for a signal (e.g. -9 after a timeout kill)."""
    timed_out: bool
    """Killed at the wall-clock limit or by the CPU-time limit."""
    stdout: str
    """Tail of what the program wrote to fd 1."""
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _tail(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_python(source: str, limits: SandboxLimits = SandboxLimits(), *, stdin: str = "",
               files: Optional[Mapping[str, str]] = None) -> SandboxResult:
    """Run ``source`` as ``__main__`` in the sandbox; ``files`` are written to its working dir first."""
    boot = _BOOT.format(memory=limits.memory_mb << 20, cpu=limits.cpu_limit_s, fsize=limits.file_size_mb << 20)
    with tempfile.TemporaryDirectory(prefix="dpcc-sandbox-") as tmp:
        for name, text in {**(files or {}), "main.py": source, "boot.py": boot}.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        out_path, err_path = os.path.join(tmp, ".stdout"), os.path.join(tmp, ".stderr")
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        start = time.monotonic()
        timed_out = False
        # Output goes to files, not pipes: RLIMIT_FSIZE caps them, so a print loop cannot flood the trainer.
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([limits.python, "-I", "boot.py"], cwd=tmp, env=env, stdin=subprocess.PIPE,
                                    stdout=out, stderr=err, start_new_session=True, close_fds=True)
            try:
                try:
                    proc.communicate(stdin.encode("utf-8"), timeout=limits.timeout_s)
                except (BrokenPipeError, OSError):
                    proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.returncode is None:  # still unreaped, so its pid cannot have been reused
                    _kill_group(proc)
        duration = time.monotonic() - start
        rc = proc.returncode
        timed_out = timed_out or rc == -signal.SIGXCPU
        return SandboxResult(returncode=rc, timed_out=timed_out, stdout=_tail(out_path, _OUTPUT_TAIL),
                             stderr=_tail(err_path, 8192), duration_s=duration)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the payload's own session: also kills anything it started
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
