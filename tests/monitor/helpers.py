"""HTTP/wait helpers for the monitor tests."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from dpcc_megatron.config.monitor import MonitorConfig


def http(method, url, body=None, token=None, headers=None, timeout=5.0):
    """(status, parsed JSON or raw bytes); HTTP errors are returned, not raised."""
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def wait_for(pred, timeout=15.0, interval=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


#: The KL window warning alone (kl_threshold 0.8 for kl_window 3, the document's example), without the
#: calibrated critical KL rules, for the tests whose stream exercises that warning (_record's 0.95s).
KL_WARNING_ONLY = dict(kl_critical_threshold=None, kl_sustained_threshold=None)


def fast_cfg(**kw) -> MonitorConfig:
    """A config with short client timeouts/backoff so tests run quickly."""
    base = dict(request_timeout_s=1.0, retry_max_backoff_s=0.3, control_poll_interval_s=0.2,
                flush_interval_s=0.02)
    base.update(kw)
    return MonitorConfig(**base)
