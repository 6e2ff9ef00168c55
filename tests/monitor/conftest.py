"""Shared helpers for the monitor tests: sidecar subprocesses are always cleaned up."""
from __future__ import annotations

import pytest

from dpcc_megatron.monitor.launcher import start_sidecar


@pytest.fixture
def sidecars():
    """Factory: ``sidecars(db, **kw)`` starts a sidecar subprocess; all are stopped/killed at teardown."""
    started = []

    def _start(db, **kw):
        kw.setdefault("ready_timeout", 30.0)
        h = start_sidecar(str(db), **kw)
        started.append(h)
        return h

    yield _start
    for h in started:
        try:
            h.stop(timeout=5)
        finally:
            if h.alive():
                h.kill()
