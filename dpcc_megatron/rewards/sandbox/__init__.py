"""Running model-written code: isolated, with a verdict decided outside the code's process.

    limits = SandboxLimits.from_config(cfg.reward.sandbox)
    sandbox = build_sandbox(limits)      # checks isolation now; refuses if none is available
    verdict = sandbox.run_tests(code, tests, partial=False)   # {passed, total, error, timed_out}

Two backends (``reward.sandbox.backend``):

* ``local`` (:mod:`.local`): one process per run on this node, isolated as
  ``reward.sandbox.isolation`` says (:mod:`.isolation`: bubblewrap or user/mount/PID/network/IPC
  namespaces, rlimits and a seccomp filter);
* ``remote`` (:mod:`.remote`): a SandboxFusion service over HTTP (``POST /run_code``).

In both the tests run in the trusted process (:mod:`.judge`) and reach the solution through
:mod:`.driver`'s plain-data protocol. Design and limits: docs/sandbox.md.
"""
from __future__ import annotations

import copy
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field

from ...config.reward import RemoteSandboxConfig
from . import isolation
from .judge import SandboxStop, SandboxUnavailable, Session, run_judge, statements
from .local import LocalProcess, rlimits

log = logging.getLogger(__name__)

__all__ = ["SandboxLimits", "LocalSandbox", "SandboxUnavailable", "SandboxStop", "build_sandbox"]


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits and backend choice; see :class:`dpcc_megatron.config.reward.SandboxConfig`."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    cpu_s: int = 0
    file_size_mb: int = 16
    scratch_mb: int = 64
    isolation: str = "auto"
    backend: str = "local"
    remote: RemoteSandboxConfig = field(default_factory=RemoteSandboxConfig)
    python: str = sys.executable

    @classmethod
    def from_config(cls, cfg) -> "SandboxLimits":
        return cls(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, cpu_s=cfg.cpu_s, file_size_mb=cfg.file_size_mb,
                   scratch_mb=cfg.scratch_mb, isolation=cfg.isolation, backend=cfg.backend,
                   remote=copy.deepcopy(cfg.remote))

    @property
    def cpu_limit_s(self) -> int:
        return self.cpu_s or int(math.ceil(self.timeout_s)) + 1


class LocalSandbox:
    """Runs each solution in its own isolated process on this node."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self.mode = isolation.resolve(limits.isolation, limits.python)
        if self.mode == "none":
            log.warning("reward.sandbox.isolation is none: model-written code runs with the trainer's access to "
                        "this host's files, network and processes")
        program = isolation.seccomp_program() if self.mode != "none" else None
        self.setup = {"rlimits": rlimits(limits), "seccomp": program.hex() if program else None}

    def describe(self) -> str:
        seccomp = "seccomp" if self.setup["seccomp"] else "no seccomp"
        return f"local, isolation {self.mode} ({seccomp})"

    def run_tests(self, code: str, tests: str, partial: bool = False) -> dict:
        body, total, error = statements(tests)
        if body is None:
            return {"passed": 0, "total": total, "error": error, "timed_out": False}
        deadline = time.monotonic() + self.limits.timeout_s
        proc = LocalProcess(self.limits, self.mode, deadline)
        try:
            verdict = run_judge(Session(proc), code, self.setup, body, total, partial, deadline)
            if not proc.started and not verdict["timed_out"]:
                raise SandboxUnavailable(f"the {self.mode} sandbox did not start: {verdict['error']}")
            return verdict
        finally:
            proc.close()


_BUILT: dict = {}
_BUILT_LOCK = threading.Lock()


def build_sandbox(limits: SandboxLimits):
    """The backend for ``limits`` (one per distinct limits per process). Raises
    :class:`~dpcc_megatron.config.base.ConfigError` naming ``reward.sandbox.isolation`` when the local
    backend has no isolation available."""
    key = repr(limits)  # the limits hold the (mutable, unhashable) remote config section
    with _BUILT_LOCK:  # checkers call this from the reward's worker threads
        if key not in _BUILT:
            if limits.backend == "remote":
                from .remote import RemoteSandbox

                _BUILT[key] = RemoteSandbox(limits)
            else:
                _BUILT[key] = LocalSandbox(limits)
        return _BUILT[key]
