"""The trainer never waits on the sidecar: killed/stalled sidecar, spool and resend,
bad messages rejected and counted while the sidecar keeps serving."""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

from prometheus_client.parser import text_string_to_metric_families

from dpcc_megatron.monitor.client import MonitorClient

from .helpers import KL_WARNING_ONLY, fast_cfg, http, wait_for


def _stored(db, run_id):
    conn = sqlite3.connect(db)
    try:
        return [r[0] for r in conn.execute("SELECT iteration FROM records WHERE run_id = ? ORDER BY iteration",
                                           (run_id,))]
    finally:
        conn.close()


def _timed_send(client, i, durations):
    t = time.perf_counter()
    ok = client.send({"iteration": i, "entropy": 4.0, "kl_old_new": 0.1, "grad_norm": 1.0})
    durations.append(time.perf_counter() - t)
    assert ok


def test_sidecar_stalled_then_killed_mid_run_no_record_lost(tmp_path, sidecars):
    db = tmp_path / "m.sqlite"
    cfg = fast_cfg(request_timeout_s=0.5)
    h1 = sidecars(db, cfg=cfg)
    client = MonitorClient.from_config(cfg, address=h1.address, token=h1.token, run_id="kill",
                                       output_dir=str(tmp_path))
    durations = []
    for i in range(15):  # sidecar up
        _timed_send(client, i, durations)
        time.sleep(0.005)
    wait_for(lambda: len(_stored(db, "kill")) == 15, what="first 15 records")

    os.kill(h1.pid, signal.SIGSTOP)  # slow: accepts connections, answers nothing
    try:
        for i in range(15, 25):
            _timed_send(client, i, durations)
            time.sleep(0.05)
        wait_for(lambda: client.stats()["spooled"] > 0, what="spooling while the sidecar is stalled")
    finally:
        os.kill(h1.pid, signal.SIGCONT)
    h1.kill()  # crash

    for i in range(25, 45):  # sidecar down
        _timed_send(client, i, durations)
        time.sleep(0.005)
    wait_for(lambda: client.stats()["spool_bytes"] > 0 and client.stats()["queue_depth"] == 0, what="spooled")
    assert not client.stats()["connected"]
    assert sum(durations) / len(durations) < 1e-3, "send() must stay well under 1 ms on average"
    assert max(durations) < 0.05

    h2 = sidecars(db, cfg=cfg, listen=h1.address, token=h1.token)  # restart on the same address and database
    assert h2.address == h1.address
    for i in range(45, 60):
        _timed_send(client, i, durations)
    wait_for(lambda: _stored(db, "kill") == list(range(60)), timeout=20, what="all 60 records after restart")
    assert client.close(5.0) is True
    st = client.stats()
    assert st["resent"] > 0 and st["dropped"] == 0 and st["spool_bytes"] == 0
    assert h2.healthz()["runs"]["kill"]["last_iteration"] == 59


def test_spool_left_by_a_crashed_trainer_is_resent_by_the_next(tmp_path, sidecars):
    spool = tmp_path / "spool.jsonl"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    code = f"""
import os, time
from dpcc_megatron.monitor.client import MonitorClient
c = MonitorClient({dead!r}, "tok-1234567", run_id="crash", spool_path={str(spool)!r}, flush_interval_s=0.01)
t = time.perf_counter()
for i in range(200):
    c.send({{"iteration": i, "entropy": 4.0}})
per = (time.perf_counter() - t) / 200
deadline = time.time() + 20
while c.stats()["spooled"] < 200 and time.time() < deadline:
    time.sleep(0.01)
print(per, c.stats()["spooled"], flush=True)
os._exit(0)  # crash: no close(), no atexit
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    per, spooled = out.stdout.split()
    assert int(spooled) == 200 and float(per) < 1e-3
    assert len(spool.read_text().splitlines()) == 200
    with open(spool, "ab") as f:
        f.write(b'{"iteration": 200, "entr')  # torn last line of the crash

    db = tmp_path / "m.sqlite"
    h = sidecars(db, token="tok-1234567")
    client = MonitorClient(h.address, "tok-1234567", run_id="crash", spool_path=str(spool), flush_interval_s=0.01)
    client.send({"iteration": 200, "entropy": 4.0})
    assert client.close(10.0) is True
    assert _stored(db, "crash") == list(range(201))
    assert spool.read_bytes() == b""
    conn = sqlite3.connect(db)
    attempts = conn.execute("SELECT COUNT(DISTINCT attempt) FROM records WHERE run_id='crash'").fetchone()[0]
    conn.close()
    assert attempts == 2  # the crashed process's records keep their own attempt


def test_bad_messages_rejected_counted_and_serving_continues(tmp_path, sidecars):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_hook = f"http://127.0.0.1:{s.getsockname()[1]}/hook"
    cfg = fast_cfg(max_message_bytes=4096, **KL_WARNING_ONLY)
    h = sidecars(tmp_path / "m.sqlite", cfg=cfg, webhook_url=dead_hook)
    url, tok = f"{h.url}/ingest", h.token
    good = {"records": [{"iteration": 0, "entropy": 4.0, "run_id": "bad"}]}

    assert http("POST", url, good)[0] == 401  # no token
    assert http("POST", url, good, token="wrong-token-123")[0] == 401
    assert http("GET", f"{h.url}/control?run_id=bad")[0] == 401
    assert http("POST", url, b"{not json", token=tok)[0] == 400
    assert http("POST", url, b"[1, 2, 3]", token=tok)[0] == 400
    assert http("POST", url, b"[" * 6000 + b"]" * 6000, token=tok)[0] == 413
    big = {"records": [{"iteration": 1, "run_id": "bad", "note": "x" * 200} for _ in range(40)]}
    assert http("POST", url, big, token=tok)[0] == 413
    status, resp = http("POST", url, {"records": [{"iteration": -1}, {"iteration": 2, "nested": {"a": 1}},
                                                   {"iteration": 3, "run_id": "bad", "kl_old_new": 0.9}]}, token=tok)
    assert status == 200 and resp["accepted"] == 1 and resp["invalid"] == 2
    assert "iteration must be an int" in resp["errors"][0]
    assert http("GET", f"{h.url}/nope")[0] == 404
    host, port = h.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:  # not even HTTP
        raw.sendall(b"\x00\x01garbage\r\n\r\n")
        assert b"400" in raw.recv(1000)  # base-class error page (HTTP/0.9 style, no status line)

    # still serving: a good batch, then the same batch again (idempotent resend)
    batch = {"records": [{"iteration": i, "run_id": "bad", "kl_old_new": 0.9, "kl_estimator": "k1"}
                         for i in range(4, 8)]}
    status, resp = http("POST", url + "?run_id=bad", batch, token=tok)
    assert status == 200 and resp["accepted"] == 4 and resp["duplicates"] == 0
    assert resp["advice"] and resp["advice"][0]["action"] == "reduce_lr"  # KL drift at iteration 5
    status, resp = http("POST", url, batch, token=tok)
    assert status == 200 and resp["accepted"] == 0 and resp["duplicates"] == 4
    status, ctl = http("GET", f"{h.url}/control?run_id=bad&after=0", token=tok)
    assert status == 200 and [a["action"] for a in ctl["advice"]] == ["reduce_lr"] and ctl["seq"] >= 1

    health = h.healthz()
    assert health["records"] == 5 and health["duplicates"] == 4
    rej = health["rejected"]
    assert rej == {"unauthenticated": 3, "malformed": 3, "oversized": 2, "not_found": 1, "invalid_record": 2}
    wait_for(lambda: h.healthz()["sinks"]["webhook_failures"] >= 1, what="webhook failure counted")
    fams = {f.name: f for f in text_string_to_metric_families(http("GET", f"{h.url}/metrics")[1].decode())}
    prom = {s.labels["reason"]: s.value for s in fams["dpcc_monitor_rejected"].samples if s.name.endswith("_total")}
    assert prom["oversized"] == 2.0 and prom["unauthenticated"] == 3.0
    assert h.alive()
    # config paths (relative by default) landed next to the database, not in the cwd
    assert (tmp_path / "monitor" / "alerts.jsonl").read_text().count("kl_drift") == 1
    assert (tmp_path / "monitor" / "tb" / "bad").is_dir()


def test_disabled_or_unreachable_client_is_harmless(tmp_path):
    off = MonitorClient(None)
    assert off.send({"iteration": 0}) is False and off.poll_control() is None and off.close() is True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    c = MonitorClient(dead, "tok-1234567", run_id="u", spool_path=str(tmp_path / "s.jsonl"), queue_size=8,
                      flush_interval_s=0.01)
    assert c.send({"iteration": 0, "weird": object()})  # queued; unserialisable -> dropped in the background
    for i in range(1, 5):
        c.send({"iteration": i})
    wait_for(lambda: c.stats()["spooled"] == 4, what="spooled")
    assert c.stats()["dropped"] == 1
    t = time.perf_counter()
    assert c.close(0.3) is False  # sidecar never came: records stay in the spool
    assert time.perf_counter() - t < 2.0
    assert [json.loads(x)["iteration"] for x in (tmp_path / "s.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_second_client_on_a_live_spool_gets_its_own(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    spool = tmp_path / "spool.jsonl"
    a = MonitorClient(dead, "tok-1234567", run_id="a", spool_path=str(spool), flush_interval_s=0.01)
    b = MonitorClient(dead, "tok-1234567", run_id="b", spool_path=str(spool), flush_interval_s=0.01)
    try:
        a.send({"iteration": 0})
        b.send({"iteration": 0})
        wait_for(lambda: a.stats()["spooled"] == 1 and b.stats()["spooled"] == 1, what="both spooled")
        own = tmp_path / f"spool.{os.getpid()}.jsonl"
        assert json.loads(spool.read_text())["run_id"] == "a"
        assert json.loads(own.read_text())["run_id"] == "b"
    finally:
        a.close(0.1)
        b.close(0.1)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def test_sidecar_exits_when_its_starting_process_is_gone(tmp_path):
    code = f"""
from dpcc_megatron.monitor.launcher import start_sidecar
h = start_sidecar({str(tmp_path / 'm.sqlite')!r}, exit_with_parent=True)
print(h.pid, flush=True)
"""  # the starter exits without stopping it (a crashed trainer)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    try:
        wait_for(lambda: not _alive(pid), timeout=10, what="sidecar to notice its parent is gone")
        assert "stopped" in (tmp_path / "m.sidecar.log").read_text()
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
