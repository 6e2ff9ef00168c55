"""End to end, sidecar in a subprocess: records flow, alerts fire, SQLite, Prometheus,
TensorBoard, alert sinks and the control channel."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dpcc_megatron.monitor.client import MonitorClient

from .helpers import KL_WARNING_ONLY, fast_cfg, http, wait_for


class _Webhook:
    """A loopback HTTP server collecting POSTed JSON bodies."""

    def __init__(self):
        self.bodies = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _record(i):
    kl = 0.95 if 10 <= i <= 12 else 0.05
    return {"iteration": i, "entropy": 4.0 + 0.01 * i, "kl_old_new": kl, "kl_estimator": "k3", "kl_ref": 0.01 * i,
            "repetition_rate": 0.02, "longest_repeat": 2, "language_consistency": 1.0, "perplexity": 3.2,
            "reward_mean": 0.5, "reward_std": 0.3, "grad_norm": 1.0, "tau": 1.5, "lr": 1e-5, "lr_factor": 1.0,
            "clip_frac": 0.1, "sample_utilization": 0.9, "zero_var_frac": 0.1, "mismatch_kl": 0.001,
            "steps_taken": 4, "steps_skipped": 0, "entropy_frac": 0.4, "my_extra_metric": float(i)}


def test_records_alerts_sqlite_prometheus_tensorboard_sinks(tmp_path, sidecars):
    hook = _Webhook()
    try:
        cfg = fast_cfg(entropy_band=(3.5, 5.0), **KL_WARNING_ONLY)
        h = sidecars(tmp_path / "m.sqlite", cfg=cfg, tensorboard_dir=str(tmp_path / "tb"),
                     alerts_jsonl=str(tmp_path / "alerts.jsonl"), webhook_url=hook.url)
        log = Path(h.log_path).read_text()
        assert f"listening on {h.address}" in log  # the bound address is printed (port 0 works)
        assert h.address.startswith("127.0.0.1:") and not h.address.endswith(":0")

        client = MonitorClient.from_config(cfg, address=h.address, token=h.token, run_id="e2e",
                                           output_dir=str(tmp_path))
        for i in range(20):
            assert client.send(_record(i))
        wait_for(lambda: h.healthz()["records"] == 20, what="20 records stored")
        advice = wait_for(client.poll_control, what="control advice")
        assert advice.action == "reduce_lr" and advice.factor == 0.5 and "kl_drift" in advice.rules
        assert client.poll_control() is None  # delivered once
        assert client.close(5.0) is True
        st = client.stats()
        assert st["sent"] == 20 and st["dropped"] == 0 and st["spooled"] == 0

        # SQLite: every record, every numeric field (extras too), the alert
        conn = sqlite3.connect(h.db_path)
        iters = [r[0] for r in conn.execute("SELECT iteration FROM records WHERE run_id='e2e' ORDER BY iteration")]
        assert iters == list(range(20))
        row = conn.execute("SELECT value FROM metrics WHERE run_id='e2e' AND iteration=7 AND name='my_extra_metric'"
                           ).fetchone()
        assert row == (7.0,)
        stored = json.loads(conn.execute("SELECT data FROM records WHERE iteration=3").fetchone()[0])
        assert stored["kl_estimator"] == "k3" and stored["tau"] == 1.5
        alerts = conn.execute("SELECT rule, iteration, severity FROM alerts WHERE run_id='e2e'").fetchall()
        assert alerts == [("kl_drift", 12, "warning")]
        adv = conn.execute("SELECT action, factor FROM advice WHERE run_id='e2e'").fetchall()
        assert adv == [("reduce_lr", 0.5)]
        conn.close()

        # Prometheus text parses with prometheus_client's parser
        status, text = http("GET", f"{h.url}/metrics")
        assert status == 200
        fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
        ent = [s for s in fams["dpcc_entropy"].samples if s.labels["run_id"] == "e2e"]
        assert ent[0].value == 4.0 + 0.01 * 19
        assert [s.value for s in fams["dpcc_monitor_records"].samples if s.name.endswith("_total")] == [20.0]
        kl_alerts = [s for s in fams["dpcc_monitor_alerts"].samples
                     if s.name.endswith("_total") and s.labels.get("rule") == "kl_drift"]
        assert kl_alerts and kl_alerts[0].value == 1.0
        assert "dpcc_my_extra_metric" in fams

        # sinks: JSONL and webhook
        lines = [json.loads(x) for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
        assert [(a["rule"], a["iteration"]) for a in lines] == [("kl_drift", 12)]
        assert lines[0]["details"]["estimator"] == "k3" and len(lines[0]["window"]) == 3
        wait_for(lambda: hook.bodies, what="webhook delivery")
        assert hook.bodies[0]["rule"] == "kl_drift"

        # graceful stop flushes TensorBoard events; read them back with tensorboard's loader
        assert h.stop(timeout=10) == 0
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        files = list((tmp_path / "tb" / "e2e").glob("events.out.tfevents.*"))
        assert len(files) == 1
        tags = {}
        for ev in EventFileLoader(str(files[0])).Load():
            for v in ev.summary.value:
                tags.setdefault(v.tag, []).append((ev.step, v))
        assert len(tags["policy/entropy"]) == 20
        assert "alerts/kl_drift" in tags and tags["alerts/kl_drift"][0][0] == 12
    finally:
        hook.close()


def test_sidecar_side_never_imports_torch_and_starts_fast(tmp_path):
    code = ("import sys, time; t = time.time(); import dpcc_megatron.commands.monitor, dpcc_megatron.monitor.server,"
            " dpcc_megatron.monitor.tb, dpcc_megatron.monitor.report, dpcc_megatron.monitor.store;"
            " print(time.time() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    elapsed, torch_loaded = out.stdout.split()
    assert torch_loaded == "False"
    assert float(elapsed) < 10.0


def test_cli_serve_without_db_is_an_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "monitor", "serve", "--listen", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--db is required" in out.stderr
