"""Local backend: one isolated process per run, spoken to over its stdin/stdout pipes."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import tempfile
import time
from typing import Optional

from . import isolation
from .driver import STARTED
from .judge import MAX_MESSAGE_BYTES, ChannelDead, SandboxUnavailable

_EXIT_GRACE_S = 1.0
MAX_OPEN_FILES = 256
"""RLIMIT_NOFILE in the sandbox. Pipe buffers are kernel memory outside RLIMIT_AS (64 KiB each, and
charged to the host user's pipe quota, which the trainer shares): with the host's limit a run held
over 100 MiB in 10,000 pipes."""
DRIVER_SOURCE = open(os.path.join(os.path.dirname(__file__), "driver.py"), encoding="utf-8").read()


def rlimits(limits) -> list[list]:
    """[[name, soft, hard], ...] the driver sets before the solution runs (CPU: SIGXCPU, then a second later SIGKILL)."""
    cpu = limits.cpu_limit_s
    return [["RLIMIT_AS", limits.memory_mb << 20, limits.memory_mb << 20], ["RLIMIT_CPU", cpu, cpu + 1],
            ["RLIMIT_FSIZE", limits.file_size_mb << 20, limits.file_size_mb << 20], ["RLIMIT_CORE", 0, 0],
            ["RLIMIT_NOFILE", MAX_OPEN_FILES, MAX_OPEN_FILES]]


class LocalProcess:
    """The transport of :class:`~.judge.Session` for one sandboxed driver process."""

    def __init__(self, limits, mode: str, deadline: float):
        self.deadline = deadline
        self.buf = b""
        self.started = False
        """The driver ran inside the sandbox (so a failure from then on is not the sandbox's)."""
        self.scratch = tempfile.TemporaryDirectory(prefix="dpcc-sandbox-") if mode == "none" else None
        env = isolation.sandbox_env()
        if self.scratch is not None:
            env.update(HOME=self.scratch.name, TMPDIR=self.scratch.name)
        self.err = tempfile.TemporaryFile(prefix="dpcc-sandbox-stderr-")
        argv = isolation.command(mode, limits.python, limits.scratch_mb, DRIVER_SOURCE)
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                         env=env, cwd=self.scratch.name if self.scratch else "/", close_fds=True,
                                         start_new_session=True)
        except OSError as e:
            self.close()
            raise SandboxUnavailable(f"could not start the sandbox ({argv[0]}): {e}") from None
        os.set_blocking(self.proc.stdin.fileno(), False)

    def __call__(self, line: str) -> dict:
        import json

        self._write(line.encode("utf-8"))
        while True:
            raw = self._readline()
            try:
                answer = json.loads(raw)
            except (ValueError, RecursionError):
                raise self._dead("malformed answer from the sandbox") from None
            if self.started or answer != STARTED:
                return answer
            self.started = True

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._dead("timeout", timed_out=True)
        return left

    def _write(self, data: bytes) -> None:
        fd = self.proc.stdin.fileno()
        while data:
            _, ready, _ = select.select([], [fd], [], self._remaining())
            if not ready:
                continue
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                continue
            except OSError:  # broken pipe: the process is gone
                raise self._dead("the solution's process exited") from None

    def _readline(self) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks, size = [self.buf], len(self.buf)
        while b"\n" not in chunks[-1]:
            if size > MAX_MESSAGE_BYTES:
                raise self._dead(f"answer over {MAX_MESSAGE_BYTES >> 20} MiB from the sandbox")
            ready, _, _ = select.select([fd], [], [], self._remaining())
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise self._dead("the solution's process exited")
            chunks.append(chunk)
            size += len(chunk)
        line, _, self.buf = b"".join(chunks).partition(b"\n")
        return line

    def _dead(self, reason: str, timed_out: bool = False) -> ChannelDead:
        rc = self.kill()
        if rc is not None and abs(rc) in (signal.SIGXCPU, 128 + signal.SIGXCPU):
            reason, timed_out = "CPU time limit", True
        elif not timed_out:
            reason = f"{reason} (exit {rc}): {self.stderr_tail()[-300:]}"
        return ChannelDead(reason, timed_out)

    def stderr_tail(self, limit: int = 8192) -> str:
        try:
            self.err.seek(0, os.SEEK_END)
            self.err.seek(max(0, self.err.tell() - limit))
            return self.err.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def kill(self) -> Optional[int]:
        """Kill the sandbox (its namespaces go with it) and reap it; its exit status."""
        proc = getattr(self, "proc", None)
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # still unreaped, so the pid cannot have been reused
            except (ProcessLookupError, PermissionError):
                pass
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """End of the run: end of input lets the driver exit (so the sandbox tears down and is reaped in
        order); whatever still runs after a short grace, or after a timeout, is killed."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None and time.monotonic() < self.deadline:
            try:
                proc.stdin.close()
                proc.wait(timeout=min(_EXIT_GRACE_S, self.deadline - time.monotonic()))
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for f in (getattr(self, "proc", None) and self.proc.stdin, getattr(self, "proc", None) and self.proc.stdout,
                  self.err):
            try:
                f and f.close()
            except OSError:
                pass
        if self.scratch is not None:
            self.scratch.cleanup()
