"""The metrics sidecar: HTTP on loopback, SQLite, Prometheus, TensorBoard, detector,
alert sinks and the control channel. Stdlib + prometheus_client (+ tensorboard when
event writing is on); never imports torch.

Endpoints::

    POST /ingest[?run_id=R&after=SEQ]  auth   body: one record object or {"records": [...]}
                                              -> {"accepted", "duplicates", "invalid", "errors",
                                                  "advice": [...], "seq"}
    GET  /control?run_id=R[&after=SEQ] auth   -> {"advice": [...], "seq"}
    GET  /metrics                      open   Prometheus text format
    GET  /healthz                      open   {"status": "ok", counters...}

Auth: ``Authorization: Bearer <token>`` (constant-time compare). Bodies above
``max_message_bytes`` get 413 without being read; bad JSON 400; bad/missing token 401;
each is counted (``dpcc_monitor_rejected_total{reason}``) and the server keeps serving.
Records failing the schema inside a valid batch are counted as ``invalid_record`` and
the rest of the batch is stored. Without ``after``, advice created by this request (or,
for /control, none) is returned together with the current ``seq``, so a fresh client
never replays old advice.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional
from urllib.parse import parse_qs, urlsplit

from .alerts import Alert, ControlAdvice, ControlPolicy
from .detector import CollapseDetector
from .records import RecordError, normalize_record, numeric_fields
from .sinks import AlertSinks
from .store import Store

log = logging.getLogger("dpcc_megatron.monitor")

TOKEN_ENV = "DPCC_MONITOR_TOKEN"
_PROM_SAFE = re.compile(r"[^A-Za-z0-9_]")
MAX_GAUGE_NAMES = 512
REJECT_REASONS = ("malformed", "oversized", "unauthenticated", "not_found", "invalid_record")


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class SidecarState:
    """Everything behind the HTTP handlers; ``ingest`` is serialised by ``self.lock``."""

    def __init__(self, cfg: Any, db_path: str, tensorboard_dir: Optional[str] = None,
                 alerts_jsonl: Optional[str] = None, webhook_url: Optional[str] = None):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.store = Store(db_path)
        self.policy = ControlPolicy(cfg)
        self.sinks = AlertSinks(alerts_jsonl, webhook_url, cfg.webhook_timeout_s)
        self.tb = None
        if tensorboard_dir:
            from .tb import TensorBoardWriter

            self.tb = TensorBoardWriter(tensorboard_dir)
        self.detectors: dict[str, CollapseDetector] = {}
        for run_id, state in self.store.load_detector_states().items():
            det = CollapseDetector(cfg, run_id=run_id)
            try:
                det.load_state_dict(state)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring saved detector state of run %s: %s", run_id, e)
                det = CollapseDetector(cfg, run_id=run_id)
            self.detectors[run_id] = det
        self.latest_advice: dict[str, ControlAdvice] = self.store.latest_advice()
        self.counters = {"records": 0, "duplicates": 0, "requests": 0, "alerts": 0, "advice": 0,
                         "ingest_errors": 0}
        self.rejected = {r: 0 for r in REJECT_REASONS}
        self.alert_counts: dict[tuple[str, str], int] = {}
        self.latest: dict[tuple[str, str], dict[str, float]] = {}
        self.last_iteration: dict[str, int] = {}
        self.gauge_names: set[str] = set()
        self.started = time.time()
        self.last_ingest = 0.0

    def reject(self, reason: str, n: int = 1) -> None:
        with self.lock:
            self.rejected[reason] += n

    def seq(self, run_id: str) -> int:
        adv = self.latest_advice.get(run_id)
        return adv.seq if adv is not None else 0

    def ingest(self, raw_records: list) -> dict:
        valid, errors = [], []
        for raw in raw_records:
            try:
                valid.append(normalize_record(raw))
            except RecordError as e:
                if len(errors) < 5:
                    errors.append(str(e))
        invalid = len(raw_records) - len(valid)
        alerts: list[Alert] = []
        with self.lock:
            self.counters["requests"] += 1
            self.rejected["invalid_record"] += invalid
            now = time.time()
            touched = set()
            self.store.begin()
            try:
                nums = [numeric_fields(r) for r in valid]
                fresh = self.store.insert_records(list(zip(valid, nums)), now)
                new = [valid[i] for i in fresh]
                new_nums = [nums[i] for i in fresh]
                order = sorted(range(len(new)), key=lambda i: (new[i]["run_id"], new[i]["attempt"],
                                                               new[i]["iteration"]))
                new, new_nums = [new[i] for i in order], [new_nums[i] for i in order]
                for rec in new:
                    run_id = rec["run_id"]
                    if rec["kind"] == "train":
                        det = self.detectors.get(run_id)
                        if det is None:
                            det = self.detectors[run_id] = CollapseDetector(self.cfg, run_id=run_id)
                        for alert in det.update(rec):
                            self.store.insert_alert(alert)
                            alerts.append(alert)
                            advice = self.policy.decide(alert, det.last_healthy_iteration)
                            if advice is not None:
                                self.store.insert_advice(advice)
                                self.latest_advice[run_id] = advice
                                self.counters["advice"] += 1
                        touched.add(run_id)
                for run_id in touched:
                    self.store.save_detector_state(run_id, self.detectors[run_id].state_dict())
                self.store.commit()
            except Exception:
                self.store.rollback()
                self.counters["ingest_errors"] += 1
                # in-memory detector state must match what the database kept
                saved = self.store.load_detector_states()
                for run_id in touched:
                    det = CollapseDetector(self.cfg, run_id=run_id)
                    if run_id in saved:
                        det.load_state_dict(saved[run_id])
                    self.detectors[run_id] = det
                self.latest_advice = self.store.latest_advice()
                raise
            self.counters["records"] += len(new)
            self.counters["duplicates"] += len(valid) - len(new)
            self.last_ingest = now
            for rec, numeric in zip(new, new_nums):
                key = (rec["run_id"], rec["kind"])
                cur = self.latest.setdefault(key, {})
                for name, v in numeric.items():
                    if name in self.gauge_names or len(self.gauge_names) < MAX_GAUGE_NAMES:
                        self.gauge_names.add(name)
                        cur[name] = v
                if rec["kind"] == "train":
                    self.last_iteration[rec["run_id"]] = max(rec["iteration"],
                                                             self.last_iteration.get(rec["run_id"], -1))
                if self.tb is not None:
                    try:
                        self.tb.write_record(rec, numeric)
                    except Exception as e:  # noqa: BLE001
                        log.warning("TensorBoard write failed: %s", e)
            for alert in alerts:
                self.counters["alerts"] += 1
                k = (alert.rule, alert.severity)
                self.alert_counts[k] = self.alert_counts.get(k, 0) + 1
                self.sinks.emit(alert)
                if self.tb is not None:
                    try:
                        self.tb.write_alert(alert)
                    except Exception as e:  # noqa: BLE001
                        log.warning("TensorBoard write failed: %s", e)
        return {"accepted": len(new), "duplicates": len(valid) - len(new), "invalid": invalid, "errors": errors,
                "alerts": [a.summary() for a in alerts]}

    def advice_after(self, run_id: str, after: int) -> list[dict]:
        with self.lock:
            return [a.to_dict() for a in self.store.advice_after(run_id, after)]

    def health(self) -> dict:
        with self.lock:
            return {"status": "ok", "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 3),
                    "records": self.counters["records"], "duplicates": self.counters["duplicates"],
                    "alerts": self.counters["alerts"], "rejected": dict(self.rejected),
                    "sinks": dict(self.sinks.counts),
                    "runs": {r: {"last_iteration": it} for r, it in self.last_iteration.items()}}

    def close(self) -> None:
        with self.lock:
            if self.tb is not None:
                self.tb.close()
            self.sinks.close()
            self.store.close()


class _PromCollector:
    def __init__(self, state: SidecarState):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.state
        with s.lock:
            latest = {k: dict(v) for k, v in s.latest.items()}
            counters = dict(s.counters)
            rejected = dict(s.rejected)
            alert_counts = dict(s.alert_counts)
            last_it = dict(s.last_iteration)
            advice = dict(s.latest_advice)
            sinks = dict(s.sinks.counts)
            last_ingest = s.last_ingest
        fams: dict[str, Any] = {}
        for (run_id, kind), values in sorted(latest.items()):
            for name, v in sorted(values.items()):
                pname = "dpcc_" + _PROM_SAFE.sub("_", name)
                if pname.startswith("dpcc_monitor_"):
                    pname = "dpcc_x_" + pname[5:]
                fam = fams.get(pname)
                if fam is None:
                    fam = fams[pname] = GaugeMetricFamily(pname, f"Latest value of record field {name}",
                                                          labels=["run_id", "kind"])
                fam.add_metric([run_id, kind], v)
        yield from fams.values()
        c = CounterMetricFamily("dpcc_monitor_records", "Records stored (resends excluded)")
        c.add_metric([], counters["records"])
        yield c
        c = CounterMetricFamily("dpcc_monitor_duplicates", "Resent records ignored by the idempotency key")
        c.add_metric([], counters["duplicates"])
        yield c
        c = CounterMetricFamily("dpcc_monitor_rejected", "Rejected messages/records", labels=["reason"])
        for reason, n in rejected.items():
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily("dpcc_monitor_alerts", "Alerts raised", labels=["rule", "severity"])
        for (rule, sev), n in sorted(alert_counts.items()):
            c.add_metric([rule, sev], n)
        yield c
        c = CounterMetricFamily("dpcc_monitor_sink_events", "Alert sink outcomes", labels=["outcome"])
        for k, n in sinks.items():
            c.add_metric([k], n)
        yield c
        c = CounterMetricFamily("dpcc_monitor_ingest_errors", "Ingest requests that failed to store")
        c.add_metric([], counters["ingest_errors"])
        yield c
        g = GaugeMetricFamily("dpcc_monitor_last_iteration", "Last train iteration stored", labels=["run_id"])
        for r, it in last_it.items():
            g.add_metric([r], it)
        yield g
        g = GaugeMetricFamily("dpcc_monitor_advice_seq", "Sequence number of the latest control advice",
                              labels=["run_id", "action"])
        for r, a in advice.items():
            g.add_metric([r, a.action], a.seq)
        yield g
        g = GaugeMetricFamily("dpcc_monitor_last_ingest_timestamp_seconds", "Wall time of the last ingest")
        g.add_metric([], last_ingest)
        yield g


def _make_handler(state: SidecarState, token: str, max_bytes: int):
    token_b = token.encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "dpcc-monitor/1"
        timeout = 30  # seconds a connection may idle or dribble before it is dropped

        def log_message(self, fmt, *args):  # noqa: D401 - route to logging at debug level
            log.debug("%s " + fmt, self.client_address[0], *args)

        def send_error(self, code, message=None, explain=None):
            # only the base class calls this: unparsable request line/headers, unsupported method
            state.reject("malformed")
            self.close_connection = True
            super().send_error(code, message, explain)

        def _send(self, code: int, body: bytes, ctype: str = "application/json", close: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: Any, close: bool = False) -> None:
            self._send(code, json.dumps(obj).encode(), close=close)

        def _reject(self, code: int, reason: str, msg: str, close: bool = True) -> None:
            state.reject(reason)
            self._json(code, {"error": msg, "reason": reason}, close=close)

        def _authorized(self) -> bool:
            got = self.headers.get("Authorization", "")
            if not got.startswith("Bearer "):
                return False
            return hmac.compare_digest(got[7:].strip().encode(), token_b)

        def _query(self) -> tuple[str, dict]:
            parts = urlsplit(self.path)
            return parts.path, parse_qs(parts.query)

        def do_GET(self):  # noqa: N802
            path, q = self._query()
            if path == "/healthz":
                self._json(200, state.health())
            elif path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                self._send(200, generate_latest(state.registry), CONTENT_TYPE_LATEST)
            elif path == "/control":
                if not self._authorized():
                    return self._reject(401, "unauthenticated", "missing or wrong bearer token", close=False)
                run_id = (q.get("run_id") or ["default"])[0]
                after = self._int_param(q, "after")
                seq = state.seq(run_id)
                advice = state.advice_after(run_id, after) if after is not None else []
                self._json(200, {"advice": advice, "seq": max([seq] + [a["seq"] for a in advice])})
            else:
                self._reject(404, "not_found", f"no such endpoint {path}", close=False)

        @staticmethod
        def _int_param(q: dict, name: str) -> Optional[int]:
            try:
                return int(q[name][0]) if name in q else None
            except ValueError:
                return None

        def do_POST(self):  # noqa: N802
            path, q = self._query()
            if path != "/ingest":
                return self._reject(404, "not_found", f"no such endpoint {path}")
            if not self._authorized():
                return self._reject(401, "unauthenticated", "missing or wrong bearer token")
            length_s = self.headers.get("Content-Length")
            if length_s is None or self.headers.get("Transfer-Encoding"):
                return self._reject(411, "malformed", "Content-Length required (no chunked bodies)")
            try:
                length = int(length_s)
                if length < 0:
                    raise ValueError
            except ValueError:
                return self._reject(400, "malformed", f"bad Content-Length {length_s!r}")
            if length > max_bytes:
                if length <= 4 * max_bytes:  # drain it so a well-behaved client can read the 413
                    left = length
                    while left > 0:
                        got = self.rfile.read(min(left, 1 << 16))
                        if not got:
                            break
                        left -= len(got)
                return self._reject(413, "oversized", f"body of {length} bytes exceeds the limit of {max_bytes}")
            body = self.rfile.read(length)
            if len(body) != length:
                return self._reject(400, "malformed", "body shorter than Content-Length")
            try:
                payload = json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                return self._reject(400, "malformed", f"invalid JSON: {e}", close=False)
            if isinstance(payload, dict) and "records" in payload:
                records = payload["records"]
                if not isinstance(records, list):
                    return self._reject(400, "malformed", "'records' must be a list", close=False)
            elif isinstance(payload, dict):
                records = [payload]
            else:
                return self._reject(400, "malformed", "body must be a JSON object", close=False)
            run_id = (q.get("run_id") or [None])[0]
            after = self._int_param(q, "after")
            before = state.seq(run_id) if run_id is not None and after is None else None
            try:
                result = state.ingest(records)
            except Exception as e:  # noqa: BLE001 - storage failure: tell the client to retry
                log.exception("ingest failed")
                return self._json(503, {"error": f"storage failure: {e}"})
            if run_id is not None:
                since = after if after is not None else before
                result["advice"] = state.advice_after(run_id, since)
                result["seq"] = max([state.seq(run_id)] + [a["seq"] for a in result["advice"]])
            self._json(200, result)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


class Sidecar:
    """The sidecar in this process: ``start()`` binds and serves in a thread."""

    def __init__(self, cfg: Any = None, *, listen: Optional[str] = None, db_path: Optional[str] = None,
                 token: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 alerts_jsonl: Optional[str] = None, webhook_url: Optional[str] = None):
        from ..config.monitor import MonitorConfig, parse_hostport

        self.cfg = cfg if cfg is not None else MonitorConfig()
        self.host, self.port = parse_hostport(listen or self.cfg.listen)
        self.db_path = db_path or self.cfg.db_path
        self.token = token or os.environ.get(TOKEN_ENV) or self.cfg.token
        self.token_generated = not self.token
        if not self.token:
            self.token = secrets.token_urlsafe(24)
        self.state = SidecarState(self.cfg, self.db_path, tensorboard_dir, alerts_jsonl, webhook_url)
        from prometheus_client import CollectorRegistry

        self.state.registry = CollectorRegistry(auto_describe=False)
        self.state.registry.register(_PromCollector(self.state))
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> "Sidecar":
        if not _is_loopback(self.host):
            log.warning("binding %s: the sidecar is reachable beyond loopback (token auth still applies)",
                        self.host)
        handler = _make_handler(self.state, self.token, self.cfg.max_message_bytes)
        cls = _Server
        if ":" in self.host:
            cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        self._server = cls((self.host, self.port), handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="dpcc-monitor-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.state.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def write_ready_file(path: str, info: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, p)


def serve(cfg: Any = None, *, listen: Optional[str] = None, db_path: Optional[str] = None,
          token: Optional[str] = None, tensorboard_dir: Optional[str] = None, alerts_jsonl: Optional[str] = None,
          webhook_url: Optional[str] = None, ready_file: Optional[str] = None,
          exit_with_pid: Optional[int] = None) -> int:
    """Run the sidecar until SIGTERM/SIGINT (or until ``exit_with_pid`` is gone)."""
    sidecar = Sidecar(cfg, listen=listen, db_path=db_path, token=token, tensorboard_dir=tensorboard_dir,
                      alerts_jsonl=alerts_jsonl, webhook_url=webhook_url)
    try:
        sidecar.start()
    except OSError as e:
        sidecar.state.close()
        print(f"dpcc-monitor: cannot listen on {listen or sidecar.cfg.listen}: {e}", flush=True)
        return 1
    stop = threading.Event()

    def _on_signal(signum, frame):  # noqa: ARG001
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    info = {"address": sidecar.address, "host": sidecar.host, "port": sidecar.port, "pid": os.getpid(),
            "db": str(sidecar.db_path)}
    if sidecar.token_generated:
        info["token"] = sidecar.token
    print(f"dpcc-monitor listening on {sidecar.address} (db {sidecar.db_path})", flush=True)
    if sidecar.token_generated:
        print("dpcc-monitor: no token given (--token / DPCC_MONITOR_TOKEN); generated one"
              + (f", see {ready_file}" if ready_file else " (pass --ready-file to learn it)"), flush=True)
    if ready_file:
        write_ready_file(ready_file, info)
    try:
        while not stop.wait(0.5):
            if exit_with_pid is not None and not _pid_alive(exit_with_pid):
                log.info("process %d is gone; shutting down", exit_with_pid)
                break
    finally:
        sidecar.stop()
        log.info("dpcc-monitor stopped")
    return 0
