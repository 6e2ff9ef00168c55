"""`dpcc-megatron monitor`: serve the metrics sidecar, replay a metric stream, render a report.

    dpcc-megatron monitor serve --listen 127.0.0.1:9400 --db runs/x/monitor.sqlite [--token T]
        [--tensorboard DIR] [--alerts-jsonl PATH] [--webhook URL] [--config JOB.yaml] [--ready-file F]
    dpcc-megatron monitor replay --input metrics.jsonl [--config JOB.yaml] [-o monitor.kl_threshold=0.5]
    dpcc-megatron monitor evaluate --labelled benchmarks/monitor/labelled [--split heldout|dev|all]
        [--seeds 49,50] [--family PREFIX ...]
    dpcc-megatron monitor report --db runs/x/monitor.sqlite --out report.png|report.html [--run-id R]

The token comes from --token or $DPCC_MONITOR_TOKEN (else the config's, else a random
one written to --ready-file). Only the stdlib/prometheus/tensorboard side of the monitor
package is imported here: never torch.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = sub.add_parser("serve", help="run the metrics sidecar (HTTP on loopback)")
    p.add_argument("--listen", default=None, help="HOST:PORT to bind (port 0: any free port); "
                   "default: the config's monitor.listen, 127.0.0.1:0")
    p.add_argument("--db", default=None, help="SQLite database path (default: the config's monitor.db_path)")
    p.add_argument("--token", default=None, help="shared auth token (default: $DPCC_MONITOR_TOKEN)")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard events here")
    p.add_argument("--alerts-jsonl", default=None, metavar="PATH", help="append alerts here as JSON lines")
    p.add_argument("--webhook", default=None, metavar="URL", help="POST each alert as JSON to this URL")
    p.add_argument("--config", default=None, metavar="CONFIG.yaml", help="job config (its monitor section)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. monitor.kl_threshold=0.5 (repeatable)")
    p.add_argument("--ready-file", default=None, metavar="PATH",
                   help="write {address, port, pid[, token]} as JSON here once listening")
    p.add_argument("--exit-with-pid", type=int, default=None, metavar="PID",
                   help="shut down once process PID has exited")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    p = sub.add_parser("replay", help="run the collapse detector over a recorded metric stream")
    p.add_argument("--input", required=True, metavar="metrics.jsonl", help="one JSON record per line")
    p.add_argument("--config", default=None, metavar="CONFIG.yaml", help="job config (its monitor section)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. monitor.entropy_band=[3.5,5.0] (repeatable)")

    p = sub.add_parser("evaluate", help="score the collapse detector on labelled metric streams")
    p.add_argument("--labelled", required=True, metavar="DIR", help="folder with labels.jsonl and the streams")
    p.add_argument("--split", default="heldout", choices=["dev", "heldout", "all"],
                   help="which labelled streams to replay (default: heldout)")
    p.add_argument("--seeds", default=None, metavar="S1,S2",
                   help="only the streams of these seeds (a comma list; the labels' seed field)")
    p.add_argument("--family", action="append", default=None, metavar="PREFIX",
                   help="only the streams whose family starts with PREFIX (repeatable: any of them)")
    p.add_argument("--config", default=None, metavar="CONFIG.yaml", help="job config (its monitor section)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. monitor.kl_threshold=0.5 (repeatable)")

    p = sub.add_parser("report", help="plot a run from the sidecar database (PNG or HTML)")
    p.add_argument("--db", required=True, metavar="PATH", help="sidecar SQLite database")
    p.add_argument("--out", required=True, metavar="PATH", help="report.png, or report.html (embeds the PNG)")
    p.add_argument("--run-id", default=None, help="run to plot (default: the most recently updated)")
    p.add_argument("--config", default=None, metavar="CONFIG.yaml",
                   help="job config: draws its KL threshold and explicit entropy band")


def _monitor_cfg(path, overrides):
    from ..config import ConfigError, load_config

    try:
        return load_config(path, overrides).monitor
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _serve(args) -> int:
    import logging

    from ..monitor.server import serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s dpcc-monitor %(levelname)s %(message)s")
    cfg = _monitor_cfg(args.config, args.override)
    if cfg is None:
        return 2
    db = args.db
    tb, alerts_jsonl, webhook = args.tensorboard, args.alerts_jsonl, args.webhook
    if args.config is not None:  # config paths apply only when a config was given
        from ..config import load_config
        from ..monitor.launcher import resolve_paths

        job = load_config(args.config, args.override)
        paths = resolve_paths(cfg, job.train.output_dir)
        db = db or paths["db_path"]
        tb = tb or paths["tensorboard_dir"]
        alerts_jsonl = alerts_jsonl or paths["alerts_jsonl"]
        webhook = webhook or cfg.webhook_url
    if not db:
        print("error: --db is required without --config", file=sys.stderr)
        return 2
    from ..config.monitor import parse_hostport

    listen = args.listen or cfg.listen
    try:
        parse_hostport(listen)
    except ValueError as e:
        print(f"error: --listen: {e}", file=sys.stderr)
        return 2
    if webhook and not webhook.startswith(("http://", "https://")):
        print(f"error: --webhook must be an http:// or https:// URL, got {webhook!r}", file=sys.stderr)
        return 2
    return serve(cfg, listen=listen, db_path=db, token=args.token, tensorboard_dir=tb,
                 alerts_jsonl=alerts_jsonl, webhook_url=webhook, ready_file=args.ready_file,
                 exit_with_pid=args.exit_with_pid)


def _replay(args) -> int:
    from ..monitor.alerts import ControlPolicy
    from ..monitor.detector import CollapseDetector
    from ..monitor.records import RecordError, normalize_record

    cfg = _monitor_cfg(args.config, args.override)
    if cfg is None:
        return 2
    try:
        f = open(args.input, encoding="utf-8")
    except OSError as e:
        print(f"error: cannot read {args.input}: {e.strerror}", file=sys.stderr)
        return 2
    policy = ControlPolicy(cfg)
    detectors: dict = {}
    alerts = []
    n = 0
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except ValueError as e:
                print(f"error: {args.input}:{lineno}: invalid JSON: {e}", file=sys.stderr)
                return 2
            try:
                rec = normalize_record(raw)
            except RecordError as e:
                print(f"error: {args.input}:{lineno}: {e}", file=sys.stderr)
                return 2
            if rec["kind"] != "train":
                continue
            n += 1
            det = detectors.get(rec["run_id"])
            if det is None:
                det = detectors[rec["run_id"]] = CollapseDetector(cfg, run_id=rec["run_id"])
            for alert in det.update(rec):
                alerts.append(alert)
                print(alert)
                advice = policy.decide(alert, det.last_healthy_iteration)
                if advice is not None:
                    extra = (f" x{advice.factor:g}" if advice.action == "reduce_lr" else
                             f" to iteration {advice.to_iteration}" if advice.action == "rollback" else "")
                    print(f"    -> control advice: {advice.action}{extra}")
    print(f"# {n} records, {len(alerts)} alerts", file=sys.stderr)
    for run, det in detectors.items():  # what the rules judged against
        band = "not set" if det.band is None else f"[{det.band[0]:.4g}, {det.band[1]:.4g}] ({det.band_source})"
        print(f"# run {run}: entropy band {band}; last healthy iteration {det.last_healthy_iteration}",
              file=sys.stderr)
    print(json.dumps({"alerts": [a.summary() for a in alerts]}))
    return 0


def _evaluate(args) -> int:
    from ..monitor.evaluate import LabelError, evaluate

    seeds = None
    if args.seeds is not None:
        try:
            seeds = {int(x) for x in args.seeds.split(",")}
        except ValueError:
            print(f"error: --seeds: a comma list of integers, got {args.seeds!r}", file=sys.stderr)
            return 2
    cfg = _monitor_cfg(args.config, args.override)
    if cfg is None:
        return 2
    try:
        results, scores = evaluate(args.labelled, cfg, None if args.split == "all" else args.split, seeds,
                                   args.family)
    except LabelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max([48, *(len(r.name) for r in results)])  # whole names: the table is read back by name
    print(f"{'stream':{width}s} {'label':9s} {'iters':>5s} {'confirmed@':>10s} {'half@':>6s} {'lead':>5s} "
          f"{'warn':>5s}  rules")
    for r in results:
        fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
        print(f"{r.name:{width}s} {r.label:9s} {r.iterations:5d} {fmt(r.first_confirmed):>10s} "
              f"{fmt(r.half_reward):>6s} {fmt(r.lead):>5s} {r.warnings:5d}  {','.join(r.rules)}")
    print(json.dumps(scores))
    return 0


def _report(args) -> int:
    from ..monitor.report import render_report
    from ..monitor.store import load_run

    try:
        records, alerts = load_run(args.db, args.run_id)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - sqlite errors: not a sidecar database
        print(f"error: cannot read {args.db}: {e}", file=sys.stderr)
        return 2
    kl, band = None, None
    if args.config:
        cfg = _monitor_cfg(args.config, [])
        if cfg is None:
            return 2
        kl, band = cfg.kl_threshold, cfg.entropy_band
    if not records:
        print(f"warning: no train records{' for run ' + args.run_id if args.run_id else ''} in {args.db}",
              file=sys.stderr)
    run = records[0].get("run_id") if records else args.run_id
    evals = load_run(args.db, run, kind="eval")[0] if run else []  # the held-out eval panel
    out = render_report(records + evals, alerts, args.out, kl_threshold=kl, entropy_band=band,
                        title=f"DPCC monitor report: {records[0].get('run_id', '') if records else args.db}")
    print(f"wrote {out} ({len(records)} records, {len(alerts)} alerts)")
    return 0


def main(args: argparse.Namespace) -> int:
    return {"serve": _serve, "replay": _replay, "evaluate": _evaluate, "report": _report}[args.action](args)
