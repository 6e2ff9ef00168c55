"""Multi-scale monitor: trainer-side metrics and client, the metrics sidecar, the
collapse detector, and offline replay/report tools. See docs/monitor.md.

Importing this package is cheap and never imports torch; names are loaded on first use.

Trainer side::

    from dpcc_megatron.monitor import MonitorClient, start_sidecar, response_metrics

Sidecar side (``dpcc-megatron monitor serve``) uses only :mod:`.server` and what it
imports: stdlib, sqlite3, prometheus_client, tensorboard's event writer.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MonitorClient": "client",
    "Alert": "alerts",
    "ControlAdvice": "alerts",
    "ControlPolicy": "alerts",
    "RULES": "alerts",
    "ACTIONS": "alerts",
    "CollapseDetector": "detector",
    "run_detector": "detector",
    "RECORD_FIELDS": "records",
    "start_sidecar": "launcher",
    "SidecarHandle": "launcher",
    "resolve_paths": "launcher",
    "Sidecar": "server",
    "render_report": "report",
    "load_run": "store",
    "repetition_stats": "metrics",
    "batch_repetition": "metrics",
    "repetition_stats_torch": "metrics",
    "language_consistency": "metrics",
    "perplexity": "metrics",
    "perplexity_torch": "metrics",
    "entropy_fraction": "metrics",
    "token_entropy_torch": "metrics",
    "response_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
