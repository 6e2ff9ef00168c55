"""Alert sinks: the log, a JSONL file, an HTTP webhook (stdlib only).

Sinks never raise into the sidecar: failures are counted. The webhook posts from its
own thread through a bounded queue, so a slow or dead endpoint never delays ingest.
"""
from __future__ import annotations

import logging
import queue
import threading
import urllib.request
from pathlib import Path
from typing import Optional

from .alerts import Alert
from .records import dumps_strict

log = logging.getLogger("dpcc_megatron.monitor")


class AlertSinks:
    def __init__(self, jsonl_path: Optional[str] = None, webhook_url: Optional[str] = None,
                 webhook_timeout_s: float = 2.0, webhook_queue: int = 1024):
        self.counts = {"log": 0, "jsonl": 0, "jsonl_errors": 0, "webhook_sent": 0, "webhook_failures": 0,
                       "webhook_dropped": 0}
        self._lock = threading.Lock()
        self._jsonl = None
        if jsonl_path:
            Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl_path, "a", encoding="utf-8")
        self.webhook_url = webhook_url
        self.webhook_timeout_s = webhook_timeout_s
        self._q: "queue.Queue[Optional[bytes]]" = queue.Queue(maxsize=webhook_queue)
        self._thread = None
        if webhook_url:
            self._thread = threading.Thread(target=self._webhook_loop, name="dpcc-monitor-webhook", daemon=True)
            self._thread.start()

    def _inc(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def emit(self, alert: Alert) -> None:
        level = logging.ERROR if alert.severity == "critical" else logging.WARNING
        log.log(level, "ALERT run=%s %s", alert.run_id, alert)
        self._inc("log")
        line = dumps_strict(alert.to_dict())
        if self._jsonl is not None:
            try:
                self._jsonl.write(line + "\n")
                self._jsonl.flush()
                self._inc("jsonl")
            except OSError as e:
                self._inc("jsonl_errors")
                log.warning("alert JSONL sink failed: %s", e)
        if self._thread is not None:
            try:
                self._q.put_nowait(line.encode())
            except queue.Full:
                self._inc("webhook_dropped")

    def _webhook_loop(self) -> None:
        while True:
            body = self._q.get()
            if body is None:
                return
            try:
                req = urllib.request.Request(self.webhook_url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=self.webhook_timeout_s) as resp:
                    resp.read(1 << 16)
                    ok = 200 <= resp.status < 300
            except Exception as e:  # noqa: BLE001 - any failure is counted, never raised
                ok = False
                log.debug("webhook POST failed: %s", e)
            self._inc("webhook_sent" if ok else "webhook_failures")

    def close(self, timeout: float = 2.0) -> None:
        if self._thread is not None:
            try:
                self._q.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        if self._jsonl is not None:
            try:
                self._jsonl.close()
            except OSError:
                pass
