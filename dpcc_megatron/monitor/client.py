"""Trainer-side client of the metrics sidecar. Never blocks, never raises.

    client = MonitorClient.from_config(cfg.monitor, address=handle.address, token=handle.token,
                                       run_id="exp1", output_dir=cfg.train.output_dir)
    for it in ...:
        client.send({"iteration": it, "entropy": ent, "kl_old_new": kl, "kl_estimator": "k3", ...})
        advice = client.poll_control()          # ControlAdvice or None, never waits
        # or, for advice at a deterministic point: client.wait_delivered(it, timeout=10) first
        if advice is not None and advice.action == "reduce_lr": lr_factor *= advice.factor
    client.close(timeout=5)

``send`` copies the record into a bounded queue (a few microseconds) and returns; a
background thread serialises records to JSON, posts them in batches and fetches
control advice. When the sidecar is down, slow or refuses the token, records go to a
local JSONL spool (appended in order) and are resent when it answers again; the
sidecar's idempotency key ``(run_id, attempt, iteration, kind)`` drops resends, so
delivery is at-least-once with no duplicates stored. A spool left by a crashed
process is resent by the next client that opens it. Records are dropped, and
counted in :meth:`stats`, only when the queue is full, a record cannot be
serialised or exceeds the message limit, the spool is full, or the sidecar rejects
the record as invalid.

``attempt`` identifies a trainer segment: it defaults to the current time in ms, so
a restarted trainer that re-runs iterations after resuming from a checkpoint does not
collide with the records of the crashed one; :meth:`notify_rollback` starts a new one.
"""
from __future__ import annotations

import atexit
import http.client
import json
import logging
import math
import os
import queue
import re
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import quote

from .alerts import ControlAdvice

log = logging.getLogger("dpcc_megatron.monitor.client")

TOKEN_ENV = "DPCC_MONITOR_TOKEN"
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_ENVELOPE = 32  # bytes of '{"records":[' ... ']}' framing, generously


def _default(obj: Any) -> Any:
    item = getattr(obj, "item", None)
    if callable(item):  # numpy / torch scalars
        return item()
    if hasattr(obj, "__float__"):
        return float(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


class MonitorClient:
    """Bounded-queue, background-thread client. See the module docstring."""

    def __init__(self, address: Optional[str], token: Optional[str] = None, *, run_id: str = "default",
                 spool_path: Optional[str] = None, queue_size: int = 4096, max_message_bytes: int = 1 << 20,
                 batch_max_records: int = 256, flush_interval_s: float = 0.05,
                 control_poll_interval_s: float = 1.0, request_timeout_s: float = 2.0,
                 retry_max_backoff_s: float = 2.0, spool_max_bytes: int = 256 << 20, enabled: bool = True,
                 attempt: Optional[int] = None):
        self.address = address
        self.run_id = run_id
        self.enabled = bool(enabled and address)
        self.attempt = int(attempt) if attempt is not None else int(time.time() * 1000)
        self._token = token or os.environ.get(TOKEN_ENV) or ""
        self._max_bytes = int(max_message_bytes)
        self._batch_max = int(batch_max_records)
        self._flush_interval = float(flush_interval_s)
        self._control_interval = float(control_poll_interval_s)
        self._timeout = float(request_timeout_s)
        self._max_backoff = float(retry_max_backoff_s)
        self._spool_max = int(spool_max_bytes)
        self._q: "queue.Queue" = queue.Queue(maxsize=int(queue_size))
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: list[ControlAdvice] = []
        self._delivered = threading.Condition(self._lock)
        self._acked: tuple[int, int] = (-1, -1)  # (attempt, highest train iteration the sidecar acknowledged)
        self._latest: Optional[ControlAdvice] = None
        self._seq: Optional[int] = None
        self._closing = False
        self._close_deadline = math.inf
        self._wake = threading.Event()
        self._dropped_full = 0  # written only by send() (the trainer thread)
        self._stats = {"sent": 0, "duplicates": 0, "spooled": 0, "resent": 0, "dropped": 0, "rejected": 0,
                       "send_errors": 0, "auth_errors": 0, "control_polls": 0, "advice_received": 0}
        self._connected = False
        self._down_since: Optional[float] = None
        self._retry_at = 0.0
        self._backoff = 0.1
        self._next_control = 0.0
        self._conn: Optional[http.client.HTTPConnection] = None
        self._spool_path: Optional[Path] = None
        self._spool_f = None
        self._spool_size = 0
        self._spool_offset = 0
        self._thread: Optional[threading.Thread] = None
        if not self.enabled:
            return
        from ..config.monitor import parse_hostport

        self._host, self._port = parse_hostport(address)
        self._open_spool(spool_path)
        self._thread = threading.Thread(target=self._run, name="dpcc-monitor-client", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (ref() is not None) and ref().close(timeout=2.0))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: Any, *, address: Optional[str] = None, token: Optional[str] = None,
                    run_id: Optional[str] = None, output_dir: Optional[str] = None,
                    attempt: Optional[int] = None) -> "MonitorClient":
        """Client from a :class:`MonitorConfig`. ``address``/``token`` override the config
        (pass the launcher handle's); relative ``spool_path`` resolves against ``output_dir``,
        whose last path component is the run id when neither ``run_id`` nor ``cfg.run_id`` is set.
        A disabled config (or no address anywhere) gives a client whose methods are no-ops."""
        if not (run_id or cfg.run_id) and output_dir:
            run_id = _SAFE.sub("_", Path(output_dir).resolve().name) or None
        run_id = run_id or cfg.run_id or "default"
        spool = cfg.spool_path or f"monitor/spool-{_SAFE.sub('_', run_id)}.jsonl"
        if output_dir is not None and not os.path.isabs(spool):
            spool = os.path.join(output_dir, spool)
        elif output_dir is None and cfg.spool_path is None:
            spool = None
        return cls(address or cfg.address, token or cfg.token, run_id=run_id, spool_path=spool,
                   queue_size=cfg.queue_size, max_message_bytes=cfg.max_message_bytes,
                   batch_max_records=cfg.batch_max_records, flush_interval_s=cfg.flush_interval_s,
                   control_poll_interval_s=cfg.control_poll_interval_s, request_timeout_s=cfg.request_timeout_s,
                   retry_max_backoff_s=cfg.retry_max_backoff_s, spool_max_bytes=cfg.spool_max_bytes,
                   enabled=cfg.enabled, attempt=attempt)

    # ------------------------------------------------------------------ trainer API
    def send(self, record: Mapping, kind: str = "train") -> bool:
        """Queue one record (needs ``iteration``); True if queued. Never blocks or raises."""
        if not self.enabled or self._closing:
            return False
        try:
            if os.getpid() != self._pid:  # forked child: the thread did not come along
                return False
            self._q.put_nowait((dict(record), kind, self.attempt, time.time()))
            return True
        except queue.Full:
            self._dropped_full += 1
            return False
        except Exception:  # noqa: BLE001 - never raise into training
            self._dropped_full += 1
            return False

    def poll_control(self) -> Optional[ControlAdvice]:
        """Advice fetched since the last call (merged: strongest action, reduce_lr factors
        multiplied), or None. Never waits on the network."""
        if not self._pending:
            return None
        with self._lock:
            pending, self._pending = self._pending, []
        return ControlAdvice.merge(pending)

    def wait_delivered(self, iteration: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the sidecar has acknowledged this attempt's train record of
        ``iteration``; its advice is then in what :meth:`poll_control` returns. False on time-out
        (sidecar down or slow) or when the client is disabled. Never raises."""
        if not self.enabled or self._thread is None:
            return False
        try:
            with self._delivered:
                return self._delivered.wait_for(
                    lambda: self._acked[0] == self.attempt and self._acked[1] >= iteration, timeout=max(0.0, timeout))
        except Exception:  # noqa: BLE001 - never raise into training
            return False

    @property
    def latest_advice(self) -> Optional[ControlAdvice]:
        """The most recent advice received (whether or not poll_control returned it)."""
        return self._latest

    def notify_rollback(self, to_iteration: Optional[int] = None) -> int:
        """Call after rolling back: starts a new ``attempt`` so re-run iterations are stored
        (not dropped as resends) and the detector restarts its windows. Returns the attempt."""
        self.attempt = max(self.attempt + 1, int(time.time() * 1000))
        with self._lock:
            self._pending = []
        if to_iteration is not None:
            self.send({"iteration": int(to_iteration), "event": "rollback"}, kind="rollback")
        return self.attempt

    def stats(self) -> dict:
        """Counters: sent, duplicates, spooled, resent, dropped, rejected, send_errors,
        auth_errors, queue_depth, spool_bytes, connected."""
        with self._lock:
            out = dict(self._stats)
        out["dropped"] += self._dropped_full
        out["queue_depth"] = self._q.qsize()
        out["spool_bytes"] = max(0, self._spool_size - self._spool_offset)
        out["connected"] = self._connected
        return out

    def close(self, timeout: float = 5.0) -> bool:
        """Flush queued and spooled records for up to ``timeout`` s; True if all were delivered
        (otherwise they stay in the spool for the next client). Never raises."""
        if self._thread is None:
            return not self.enabled
        try:
            if not self._closing:
                self._close_deadline = time.monotonic() + max(0.0, timeout)
                self._closing = True
            self._wake.set()
            self._thread.join(max(0.0, timeout) + 0.5)
            return (not self._thread.is_alive()) and self._q.empty() and self._spool_size == self._spool_offset
        except Exception:  # noqa: BLE001
            return False

    def __enter__(self) -> "MonitorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ background thread
    def _inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _run(self) -> None:
        try:
            while True:
                items = self._drain()
                lines = self._serialize(items) if items else []
                now = time.monotonic()
                if lines:
                    if self._spool_size > self._spool_offset or now < self._retry_at:
                        self._spool_append(lines)
                    else:
                        rest = self._post_lines(lines, resend=False)
                        if rest:
                            self._spool_append(rest)
                if self._spool_size > self._spool_offset and time.monotonic() >= self._retry_at:
                    self._drain_spool(budget_s=0.25)
                if self._closing:
                    now = time.monotonic()
                    if self._q.empty() and self._spool_size == self._spool_offset:
                        break
                    if now >= self._close_deadline:  # out of time: keep the rest for the next client
                        self._spool_append(self._serialize(self._drain(block=False)))
                        break
                    self._retry_at = min(self._retry_at, now + 0.1)  # down while closing: retry soon
                    time.sleep(min(0.02, max(0.0, self._retry_at - now)))
                elif time.monotonic() >= self._next_control and time.monotonic() >= self._retry_at:
                    self._poll()
        except Exception:  # noqa: BLE001 - the thread must never take the trainer down
            log.exception("monitor client thread failed; records from now on are dropped")
        finally:
            self._close_conn()
            if self._spool_f is not None:
                try:
                    self._spool_f.close()
                except OSError:
                    pass

    def _drain(self, block: bool = True) -> list:
        items = []
        if block and not self._closing:
            try:
                items.append(self._q.get(timeout=self._flush_interval))
            except queue.Empty:
                return items
        while len(items) < 4 * self._batch_max:
            try:
                items.append(self._q.get_nowait())
            except queue.Empty:
                break
        return items

    def _serialize(self, items: list) -> list[bytes]:
        lines = []
        for rec, kind, attempt, t in items:
            try:
                rec.setdefault("run_id", self.run_id)
                rec.setdefault("kind", kind)
                rec.setdefault("attempt", attempt)
                rec.setdefault("time", t)
                line = json.dumps(rec, separators=(",", ":"), default=_default).encode()
            except Exception:  # noqa: BLE001
                self._inc("dropped")
                continue
            if len(line) + _ENVELOPE > self._max_bytes:
                self._inc("dropped")
                continue
            lines.append(line)
        return lines

    # -- HTTP
    def _close_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001
                pass
            self._conn = None

    def _request(self, method: str, path: str, body: Optional[bytes] = None) -> tuple[int, Optional[dict]]:
        """(status, json) or (0, None) on a transport failure (then marks the sidecar down)."""
        headers = {"Authorization": f"Bearer {self._token}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):  # one silent retry on a stale keep-alive connection
            try:
                if self._conn is None:
                    self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
                self._conn.request(method, path, body=body, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self._close_conn()
                try:
                    parsed = json.loads(data) if data else None
                except ValueError:
                    parsed = None
                self._mark_up()
                return resp.status, parsed
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self._close_conn()
                if attempt == 0:
                    continue
                self._mark_down(e)
                return 0, None
            except Exception as e:  # noqa: BLE001 - refused, timeout, DNS...
                self._close_conn()
                self._mark_down(e)
                return 0, None
        return 0, None

    def _mark_up(self) -> None:
        if not self._connected:
            if self._down_since is not None:
                log.info("monitor sidecar at %s is back after %.1f s", self.address,
                         time.monotonic() - self._down_since)
            self._connected = True
            self._down_since = None
        self._backoff = 0.1

    def _mark_down(self, err: Any) -> None:
        self._inc("send_errors")
        if self._connected or self._down_since is None:
            log.warning("monitor sidecar at %s unreachable (%s); spooling to %s", self.address, err,
                        self._spool_path)
            self._down_since = time.monotonic()
        self._connected = False
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._max_backoff)

    def _query(self) -> str:
        q = f"run_id={quote(self.run_id, safe='')}"
        if self._seq is not None:
            q += f"&after={self._seq}"
        return q

    def _take_advice(self, resp: Optional[dict]) -> None:
        if not isinstance(resp, dict):
            return
        adv = [ControlAdvice.from_dict(a) for a in resp.get("advice") or [] if isinstance(a, dict)]
        seq = resp.get("seq")
        with self._lock:
            if adv:
                self._pending.extend(adv)
                self._latest = adv[-1]
                self._stats["advice_received"] += len(adv)
            if isinstance(seq, int):
                self._seq = max(seq, self._seq or 0, *(a.seq for a in adv))

    def _poll(self) -> None:
        self._next_control = time.monotonic() + self._control_interval
        status, resp = self._request("GET", f"/control?{self._query()}")
        if status == 200:
            self._inc("control_polls")
            self._take_advice(resp)
        elif status == 401:
            self._auth_failed()

    def _mark_delivered(self, chunk: list[bytes]) -> None:
        """Record the highest train iteration of this attempt in an acknowledged chunk (its
        advice was taken first, so a waiter that wakes up finds it pending)."""
        best = -1
        for line in chunk:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "train" and rec.get("attempt") == self.attempt and isinstance(rec.get("iteration"), int):
                best = max(best, rec["iteration"])
        if best >= 0:
            with self._delivered:
                if self._acked[0] != self.attempt or best > self._acked[1]:
                    self._acked = (self.attempt, best)
                self._delivered.notify_all()

    def _auth_failed(self) -> None:
        self._inc("auth_errors")
        if self._stats["auth_errors"] == 1:
            log.error("monitor sidecar at %s rejected the token; spooling records", self.address)
        self._retry_at = time.monotonic() + self._max_backoff

    def _chunks(self, lines: list[bytes]):
        chunk, size = [], _ENVELOPE
        for line in lines:
            if chunk and (len(chunk) >= self._batch_max or size + len(line) + 1 > self._max_bytes):
                yield chunk
                chunk, size = [], _ENVELOPE
            chunk.append(line)
            size += len(line) + 1
        if chunk:
            yield chunk

    def _post_lines(self, lines: list[bytes], resend: bool) -> list[bytes]:
        """Post ``lines`` in batches; return the ones not delivered (to spool)."""
        chunks = list(self._chunks(lines))
        for i, chunk in enumerate(chunks):
            if not self._post_chunk(chunk, resend):
                return [line for c in chunks[i:] for line in c]
        return []

    def _post_chunk(self, chunk: list[bytes], resend: bool) -> bool:
        """True when the chunk is settled (stored, or dropped as unacceptable)."""
        body = b'{"records":[' + b",".join(chunk) + b"]}"
        status, resp = self._request("POST", f"/ingest?{self._query()}", body)
        if status == 200:
            resp = resp if isinstance(resp, dict) else {}
            accepted, dup, invalid = (int(resp.get(k, 0) or 0) for k in ("accepted", "duplicates", "invalid"))
            with self._lock:
                self._stats["sent"] += accepted + dup
                self._stats["duplicates"] += dup
                self._stats["rejected"] += invalid
                self._stats["dropped"] += invalid
                if resend:
                    self._stats["resent"] += accepted + dup
            self._take_advice(resp)
            self._mark_delivered(chunk)
            self._next_control = time.monotonic() + self._control_interval
            return True
        if status in (400, 413) and len(chunk) > 1:  # isolate the offending record(s)
            mid = len(chunk) // 2
            return self._post_chunk(chunk[:mid], resend) and self._post_chunk(chunk[mid:], resend)
        if status in (400, 413):
            self._inc("dropped")
            self._inc("rejected")
            return True
        if status == 401:
            self._auth_failed()
        elif status != 0:
            self._mark_down(f"HTTP {status}")
        return False

    # -- spool
    def _open_spool(self, spool_path: Optional[str]) -> None:
        path = Path(spool_path) if spool_path else (
            Path(tempfile.gettempdir()) / f"dpcc-monitor-spool-{_SAFE.sub('_', self.run_id)}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+b")
        try:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:
            pass
        except OSError:  # another live client owns it: use a private one
            f.close()
            path = path.with_name(f"{path.stem}.{os.getpid()}{path.suffix}")
            f = open(path, "a+b")
        self._spool_path, self._spool_f = path, f
        f.seek(0)
        data = f.read()
        if data:  # left by a crashed process: keep the complete, parseable lines
            good = []
            for line in data.split(b"\n"):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                    good.append(line)
                except ValueError:
                    self._inc("dropped")
            f.seek(0)
            f.truncate()
            if good:
                f.write(b"\n".join(good) + b"\n")
            f.flush()
            log.info("monitor client: %d spooled records from a previous run will be resent", len(good))
        f.seek(0, os.SEEK_END)
        self._spool_size = f.tell()
        self._spool_offset = 0

    def _spool_append(self, lines: list[bytes]) -> None:
        if not lines:
            return
        data = b"\n".join(lines) + b"\n"
        if self._spool_f is None or self._spool_size - self._spool_offset + len(data) > self._spool_max:
            self._inc("dropped", len(lines))
            return
        try:
            self._spool_f.seek(0, os.SEEK_END)
            self._spool_f.write(data)
            self._spool_f.flush()
            self._spool_size += len(data)
            self._inc("spooled", len(lines))
        except OSError as e:
            log.warning("monitor spool write failed: %s", e)
            self._inc("dropped", len(lines))

    def _drain_spool(self, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        f = self._spool_f
        while self._spool_offset < self._spool_size and time.monotonic() < end:
            f.seek(self._spool_offset)
            data = f.read(min(self._max_bytes, self._spool_size - self._spool_offset))
            cut = data.rfind(b"\n")
            if cut < 0:  # cannot happen (records over the limit are never spooled); skip the rest
                self._spool_offset = self._spool_size
                break
            data = data[:cut + 1]
            lines = [ln for ln in data.split(b"\n") if ln]
            consumed = 0
            ok = True
            for chunk in self._chunks(lines):
                if not self._post_chunk(chunk, resend=True):
                    ok = False
                    break
                consumed += sum(len(ln) + 1 for ln in chunk)
            self._spool_offset += consumed
            if not ok:
                break
        if self._spool_offset >= self._spool_size:
            f.seek(0)
            f.truncate()
            f.flush()
            self._spool_size = self._spool_offset = 0
