"""Monitor benchmark: trainer-side cost per iteration with the sidecar up and down, and
sidecar ingest throughput.

    python benchmarks/bench_monitor.py [--iters 2000] [--records 20000] [--no-tensorboard] [--tiny]

Per iteration the trainer calls ``client.send(record)`` (a 24-field record, the
standard fields plus one extra) and ``client.poll_control()``; only those calls are
timed, with a short sleep between iterations standing in for the training step.
"Down" points the client at a port nobody listens on (it spools to disk in its thread).
Sidecar throughput: pre-serialised batches of 256 records POSTed by 2 threads to a
sidecar subprocess (SQLite + Prometheus state + TensorBoard events + detector), timed
until ``/healthz`` reports them all stored. Ends with one JSON line. ``--tiny``: 20 iterations and
512 records (checks the script runs; the figures are not a measurement).
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpcc_megatron.monitor.client import MonitorClient  # noqa: E402
from dpcc_megatron.monitor.launcher import start_sidecar  # noqa: E402
from dpcc_megatron.monitor.metrics import batch_repetition  # noqa: E402


def record(i: int, rng: random.Random) -> dict:
    return {"iteration": i, "entropy": 4.0 + rng.gauss(0, 0.05), "kl_old_new": abs(rng.gauss(0.02, 0.01)),
            "kl_estimator": "k3", "kl_ref": 0.05, "repetition_rate": 0.01, "longest_repeat": 2,
            "language_consistency": 1.0, "perplexity": 3.1, "reward_mean": 0.5, "reward_std": 0.3,
            "grad_norm": 1.0 + rng.random() * 0.1, "tau": 1.3, "lr": 1e-5, "lr_factor": 1.0, "clip_frac": 0.1,
            "sample_utilization": 0.9, "zero_var_frac": 0.1, "mismatch_kl": 1e-3, "steps_taken": 4,
            "steps_skipped": 0, "entropy_frac": 0.35, "loss": 0.12}


def client_cost(address: str, token: str, iters: int, spool: Path, run_id: str) -> dict:
    rng = random.Random(0)
    client = MonitorClient(address, token, run_id=run_id, spool_path=str(spool), retry_max_backoff_s=1.0)
    times = []
    for i in range(iters):
        rec = record(i, rng)
        t = time.perf_counter()
        client.send(rec)
        client.poll_control()
        times.append(time.perf_counter() - t)
        time.sleep(0.0005)  # the training step
    delivered = client.close(timeout=10.0)
    st = client.stats()
    times.sort()
    return {"ms_mean": 1e3 * statistics.fmean(times), "ms_p99": 1e3 * times[int(0.99 * (len(times) - 1))],
            "ms_max": 1e3 * times[-1], "delivered": delivered, "sent": st["sent"], "spooled": st["spooled"],
            "dropped": st["dropped"]}


def sidecar_throughput(handle, n_records: int, batch: int = 256, threads: int = 2) -> float:
    rng = random.Random(1)
    host, port = handle.address.rsplit(":", 1)
    bodies = []
    for start in range(0, n_records, batch):
        recs = [dict(record(i, rng), run_id="thr", attempt=0) for i in range(start, min(start + batch, n_records))]
        bodies.append(json.dumps({"records": recs}).encode())
    base = handle.healthz()["records"]
    headers = {"Authorization": f"Bearer {handle.token}", "Content-Type": "application/json"}

    def worker(part):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        for body in part:
            conn.request("POST", "/ingest", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
        conn.close()

    parts = [bodies[i::threads] for i in range(threads)]
    t = time.perf_counter()
    ths = [threading.Thread(target=worker, args=(p,)) for p in parts]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    while handle.healthz()["records"] - base < n_records:
        time.sleep(0.01)
    return n_records / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--no-tensorboard", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: checks the script runs, measures nothing")
    args = ap.parse_args()
    if args.tiny:
        args.iters, args.records = 20, 512
    work = Path(tempfile.mkdtemp(prefix="bench-monitor-"))
    handle = None
    try:
        t = time.perf_counter()
        handle = start_sidecar(str(work / "m.sqlite"),
                               tensorboard_dir=None if args.no_tensorboard else str(work / "tb"))
        startup_s = time.perf_counter() - t
        up = client_cost(handle.address, handle.token, args.iters, work / "spool-up.jsonl", "up")
        print(f"client, sidecar up:   {up}", flush=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        down = client_cost(dead, handle.token, args.iters, work / "spool-down.jsonl", "down")
        print(f"client, sidecar down: {down}", flush=True)
        rps = sidecar_throughput(handle, args.records)
        print(f"sidecar ingest: {rps:.0f} records/s ({args.records} records, batches of 256, 2 connections)",
              flush=True)
        rng = random.Random(2)
        seqs = [[rng.randrange(50) for _ in range(64)] for _ in range(64)]
        t = time.perf_counter()
        for _ in range(20):
            batch_repetition(seqs)
        rep_ms = 1e3 * (time.perf_counter() - t) / 20
        print(f"batch_repetition(64 x 64 tokens, pure python): {rep_ms:.2f} ms", flush=True)
        result = {"client_ms_per_iter_up": round(up["ms_mean"], 4), "client_ms_per_iter_down": round(down["ms_mean"], 4),
                  "sidecar_records_per_s": round(rps, 1), "client_p99_ms_up": round(up["ms_p99"], 4),
                  "client_p99_ms_down": round(down["ms_p99"], 4), "client_max_ms_up": round(up["ms_max"], 3),
                  "client_max_ms_down": round(down["ms_max"], 3), "delivered_up": up["delivered"],
                  "spooled_down": down["spooled"], "sidecar_startup_s": round(startup_s, 3),
                  "tensorboard": not args.no_tensorboard, "repetition_ms_64x64": round(rep_ms, 3)}
    finally:
        if handle is not None:
            handle.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
