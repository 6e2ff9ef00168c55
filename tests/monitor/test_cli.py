"""`dpcc-megatron monitor replay` and `report`, and render_report."""
from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import sys
import time

from dpcc_megatron.config.monitor import MonitorConfig
from dpcc_megatron.monitor.alerts import ControlPolicy
from dpcc_megatron.monitor.detector import CollapseDetector
from dpcc_megatron.monitor.report import render_report
from dpcc_megatron.monitor.store import Store, load_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "monitor", *args], capture_output=True,
                          text=True, timeout=timeout)


def _write_stream(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_replay_prints_alerts_and_final_json(tmp_path):
    recs = [{"iteration": i, "entropy": e, "kl_old_new": k, "kl_estimator": "k3", "repetition_rate": 0.01,
             "reward_mean": 0.5, "reward_std": 0.3, "grad_norm": 1.0}
            for i, (e, k) in enumerate([(4.2, 0.1), (4.1, 0.9), (4.3, 0.9), (4.2, 0.9), (6.1, 0.2), (7.8, 0.1)])]
    recs.append({"iteration": 6, "entropy": 4.0, "kl_old_new": 0.1, "repetition_rate": 0.9})
    stream = tmp_path / "metrics.jsonl"
    _write_stream(stream, recs)
    # the KL window warning (kl_threshold 0.8 for kl_window 3), without the calibrated critical KL rules
    kl_warning_only = "  kl_critical_threshold: null\n  kl_sustained_threshold: null\n"
    cfg = tmp_path / "job.yaml"
    cfg.write_text("monitor:\n  entropy_band: [3.5, 5.0]\n" + kl_warning_only)
    out = cli("replay", "--input", str(stream), "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    final = json.loads(lines[-1])
    assert final == {"alerts": [{"rule": "kl_drift", "iteration": 3, "severity": "warning"},
                                {"rule": "high_entropy", "iteration": 4, "severity": "critical"},
                                {"rule": "low_entropy", "iteration": 6, "severity": "critical"}]}
    text = "\n".join(lines[:-1])
    assert "estimator k3" in text and "control advice: reduce_lr x0.5" in text
    # without the explicit band (not yet calibrated) the 4.2 -> 7.8 rise still fires as a jump
    plain = tmp_path / "plain.yaml"
    plain.write_text("monitor:\n" + kl_warning_only)
    out = cli("replay", "--input", str(stream), "--config", str(plain))
    rules = [(a["rule"], a["iteration"]) for a in json.loads(out.stdout.strip().splitlines()[-1])["alerts"]]
    assert ("high_entropy", 5) in rules and ("kl_drift", 3) in rules
    # overrides change thresholds: a KL window of 4 never fills
    out = cli("replay", "--input", str(stream), "--config", str(plain), "-o", "monitor.kl_window=4")
    assert "kl_drift" not in out.stdout.strip().splitlines()[-1]
    # the shipped defaults: 0.9 is over kl_critical_threshold (0.5): a runaway at iteration 1
    out = cli("replay", "--input", str(stream))
    alerts = json.loads(out.stdout.strip().splitlines()[-1])["alerts"]
    assert {"rule": "kl_drift", "iteration": 1, "severity": "critical"} in alerts
    # a higher runaway threshold leaves the sustained rule: over kl_sustained_threshold (0.1) for
    # kl_sustained_window (2) iterations from iteration 1, so critical at iteration 2
    out = cli("replay", "--input", str(stream), "-o", "monitor.kl_critical_threshold=1.0")
    alerts = json.loads(out.stdout.strip().splitlines()[-1])["alerts"]
    assert {"rule": "kl_drift", "iteration": 2, "severity": "critical"} in alerts
    assert not any(a["rule"] == "kl_drift" and a["iteration"] < 2 for a in alerts)


def test_replay_names_the_malformed_line(tmp_path):
    stream = tmp_path / "bad.jsonl"
    stream.write_text('{"iteration": 0, "entropy": 4.0}\n\n{"iteration": 1, "entropy": \n')
    out = cli("replay", "--input", str(stream))
    assert out.returncode == 2 and f"{stream}:3: invalid JSON" in out.stderr
    stream.write_text('{"iteration": 0}\n{"entropy": 4.0}\n')
    out = cli("replay", "--input", str(stream))
    assert out.returncode == 2 and f"{stream}:2: iteration must be an int" in out.stderr
    out = cli("replay", "--input", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "cannot read" in out.stderr
    out = cli("replay", "--input", str(stream), "-o", "monitor.kl_window=0")
    assert out.returncode == 2 and "monitor.kl_window must be >= 1, got 0" in out.stderr


def _fill_db(db, n=40):
    cfg = MonitorConfig(entropy_band=(3.5, 5.0))
    store, det, policy = Store(db), CollapseDetector(cfg, run_id="rep"), ControlPolicy(cfg)
    store.begin()
    for i in range(n):
        rec = {"iteration": i, "run_id": "rep", "attempt": 0, "kind": "train", "entropy": 4 + (3 if i > 30 else 0),
               "kl_old_new": 0.1 + 0.02 * i, "tau": 1 + 0.01 * i, "lr_factor": 1.0 if i < 32 else 0.5,
               "reward_mean": math.sin(i / 5), "reward_std": 0.2, "repetition_rate": 0.01,
               "mismatch_kl": 0.001 * i}
        store.insert_record(rec, time.time())
        for a in det.update(rec):
            store.insert_alert(a)
            policy.decide(a, det.last_healthy_iteration)
    store.commit()
    store.close()


def test_report_png_and_html_from_db(tmp_path):
    db = tmp_path / "m.sqlite"
    _fill_db(db)
    records, alerts = load_run(db)
    assert len(records) == 40 and {a["rule"] for a in alerts} >= {"high_entropy", "kl_drift"}
    out = cli("report", "--db", str(db), "--out", str(tmp_path / "r.html"), "--run-id", "rep")
    assert out.returncode == 0, out.stderr
    doc = (tmp_path / "r.html").read_text()
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", doc).group(1))
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000  # the embedded PNG
    assert "high_entropy" in doc and "40 records" in doc
    out = cli("report", "--db", str(tmp_path / "none.sqlite"), "--out", str(tmp_path / "x.png"))
    assert out.returncode == 2 and "no such database" in out.stderr


def test_render_report_png_in_memory(tmp_path):
    recs = [{"iteration": i, "entropy": 4.0 + 0.1 * i, "kl_old_new": 0.1, "tau": 1.2} for i in range(10)]
    recs += [{"iteration": i, "attempt": 1, "entropy": 3.9} for i in range(5, 10)]  # after a rollback
    alerts = [{"rule": "kl_drift", "iteration": 4, "severity": "warning"},
              {"rule": "high_entropy", "iteration": 7, "severity": "critical", "confirmed": True}]
    p = render_report(recs, alerts, tmp_path / "sub" / "r.png", kl_threshold=0.8, entropy_band=(3.5, 5.0))
    data = p.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    empty = render_report([], [], tmp_path / "e.png")  # no data at all still renders
    assert empty.read_bytes().startswith(PNG_MAGIC)


def test_report_marks_alerts_by_severity(tmp_path):
    """A warning is a short tick at the panels' top edge, a critical a line through every panel, a
    confirmed collapse a thick one; the title and the HTML table say which is which."""
    import io

    from matplotlib.image import imread

    from dpcc_megatron.monitor.report import alert_headline, alert_style, render_figure_png

    warn = {"rule": "low_entropy", "iteration": 5, "severity": "warning"}
    crit = {"rule": "high_entropy", "iteration": 5, "severity": "critical"}
    conf = dict(crit, confirmed=True)
    assert alert_style(warn)["ymin"] >= 0.9 and alert_style(crit)["ymin"] == 0.0
    assert alert_style(conf)["lw"] > alert_style(crit)["lw"] and alert_style(conf)["ls"] == "-"
    assert alert_headline([warn, warn, crit, conf]) == "1 confirmed collapse, 1 critical, 2 warnings"
    assert alert_headline([]) == "no alerts"

    recs = [{"iteration": i, "entropy": 0.7, "kl_old_new": 0.01, "kl_step_max": 0.02, "reward_mean": 0.4,
             "reward_base_mean": 0.3} for i in range(10)]

    def pixels(alert, rgb):
        img = imread(io.BytesIO(render_figure_png(recs, [alert], title="t")))[..., :3]
        target = [int(rgb[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return int((abs(img - target).max(axis=-1) < 0.06).sum())

    # the same alert drawn as a warning leaves far fewer marks than as a critical or a confirmed collapse
    orange, red = pixels(warn, "#ff7f0e"), pixels(crit, "#d62728")
    assert 0 < 4 * orange < red < pixels(conf, "#d62728")

    html_doc = render_report(recs, [warn, conf], tmp_path / "r.html").read_text()
    assert '<tr class="sev-warning">' in html_doc and '<tr class="sev-confirmed">' in html_doc
    assert "1 confirmed collapse, 1 warning" in html_doc


def test_replay_shows_the_rules_judged_on_the_rule_track_and_per_step_kl(tmp_path):
    """A dual-track stream: the combined reward keeps its spread while the rule track has none, and
    one step's KL runs away while the iteration mean looks calm. Replay names what it judged."""
    recs = [{"iteration": i, "entropy": 0.75, "reward_mean": 0.5, "reward_std": 0.2, "zero_var_frac": 0.1,
             "reward_base_mean": 0.1, "reward_base_std": 0.0, "zero_var_frac_base": 1.0,
             "kl_old_new": 0.3, "kl_step_max": 1.5 if i == 2 else 0.02, "kl_estimator": "k3"} for i in range(8)]
    stream = tmp_path / "metrics.jsonl"
    _write_stream(stream, recs)
    out = cli("replay", "--input", str(stream), "-o", "monitor.kl_critical_threshold=1.0",
              "-o", "monitor.reward_collapse_patience=3", "-o", "monitor.entropy_band_relative=[0.5,1.6]")
    assert out.returncode == 0, out.stderr
    assert "[CRITICAL" in out.stdout and "kl_step_max" in out.stdout and "runaway" in out.stdout
    assert "rule-track reward variance collapsed" in out.stdout and "reward_base_std=0" in out.stdout
    assert "entropy band [0.375, 1.2] (0.5-1.6 x the first entropy)" in out.stderr
    final = json.loads(out.stdout.strip().splitlines()[-1])["alerts"]
    assert {"rule": "kl_drift", "iteration": 2, "severity": "critical"} in final
    assert {"rule": "reward_collapse", "iteration": 2, "severity": "warning"} in final
