"""Training report: entropy, KL, tau_t, LR factor, reward, held-out eval reward, repetition and
sampler/trainer mismatch over iterations, with alert markers. PNG, or HTML embedding the PNG.

The panels show what the detector's rules read: the KL panel has each iteration's largest
per-step KL (``kl_step_max``, what ``kl_drift`` judges) next to the iteration mean and DPCC's
post-step drift probe (``kl_probe``, the controller's input, not judged), and the reward
panel the rule track (``reward_base_mean``, what reward and template collapse are judged on).

Alerts are marked by severity so that a warning never looks like a collapse (:func:`alert_style`):
a confirmed collapse is a thick solid red line through every panel, an unconfirmed critical a
thin dashed red line, a warning only a short orange tick at the top edge of each panel. The title
counts them (:func:`alert_headline`) and the HTML table colours its rows the same way.

Records of kind ``eval`` (the trainer's ``eval.jsonl``) feed the eval panel; every other panel
reads the ``train`` records.

matplotlib is imported lazily (object-oriented API with the Agg canvas: no pyplot
global state, safe in threads and without a display).
"""
from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

PANELS: list[tuple[str, Sequence[str], str]] = [
    ("Token entropy (nats)", ("entropy",), "entropy"),
    ("KL", ("kl_old_new", "kl_step_max", "kl_probe", "kl_ref"), "kl"),
    ("DPCC τ_t", ("tau",), "tau"),
    ("LR factor", ("lr_factor",), "lr_factor"),
    ("Reward (mean ± std; rule track)", ("reward_mean", "reward_base_mean"), "reward"),
    ("Eval reward (held-out)", ("reward_greedy", "pass_at_1"), "eval"),
    ("Repetition rate", ("repetition_rate",), "repetition"),
    ("Sampler/trainer mismatch KL", ("mismatch_kl",), "mismatch"),
]
_SEV_COLOR = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#7f7f7f"}


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def _alert_dict(a: Any) -> dict:
    return a.to_dict() if hasattr(a, "to_dict") else dict(a)


def severity_of(alert: dict) -> str:
    """``confirmed`` (a confirmed collapse), ``critical``, ``warning`` or ``info``."""
    if alert.get("confirmed"):
        return "confirmed"
    sev = alert.get("severity")
    return sev if sev in ("critical", "warning") else "info"


#: How each severity is drawn: colour, line style, width, vertical extent (axes fraction), label.
_STYLES = {
    "confirmed": {"color": _SEV_COLOR["critical"], "ls": "-", "lw": 2.4, "ymin": 0.0, "ymax": 1.0,
                  "label": "confirmed collapse"},
    "critical": {"color": _SEV_COLOR["critical"], "ls": "--", "lw": 1.0, "ymin": 0.0, "ymax": 1.0,
                 "label": "critical"},
    "warning": {"color": _SEV_COLOR["warning"], "ls": "-", "lw": 2.0, "ymin": 0.9, "ymax": 1.0,
                "label": "warning"},
    "info": {"color": _SEV_COLOR["info"], "ls": ":", "lw": 0.8, "ymin": 0.94, "ymax": 1.0, "label": "info"},
}


def alert_style(alert: Any) -> dict:
    """Marker style of one alert: only criticals cross the panels; a warning is a tick at the top."""
    return dict(_STYLES[severity_of(_alert_dict(alert))])


def severity_counts(alerts: Sequence[Any]) -> dict:
    counts = {k: 0 for k in _STYLES}
    for a in alerts:
        counts[severity_of(_alert_dict(a))] += 1
    return counts


def alert_headline(alerts: Sequence[Any]) -> str:
    """E.g. ``1 confirmed collapse, 2 critical, 11 warnings`` (``no alerts`` when empty)."""
    c = severity_counts(alerts)
    parts = []
    if c["confirmed"]:
        parts.append(f"{c['confirmed']} confirmed collapse" + ("s" if c["confirmed"] > 1 else ""))
    if c["critical"]:
        parts.append(f"{c['critical']} critical")
    if c["warning"]:
        parts.append(f"{c['warning']} warning" + ("s" if c["warning"] > 1 else ""))
    if c["info"]:
        parts.append(f"{c['info']} info")
    return ", ".join(parts) or "no alerts"


def _segments(records: Iterable[dict], kind: str = "train") -> list[list[dict]]:
    """Records of ``kind`` split by attempt (a rollback re-runs iterations), each sorted by iteration."""
    by: dict[int, list[dict]] = {}
    for r in records:
        if r.get("kind", "train") != kind or "iteration" not in r:
            continue
        by.setdefault(int(r.get("attempt", 0) or 0), []).append(r)
    return [sorted(v, key=lambda r: r["iteration"]) for _, v in sorted(by.items())]


def render_figure_png(records: Sequence[dict], alerts: Sequence[Any] = (), title: Optional[str] = None,
                      kl_threshold: Optional[float] = None,
                      entropy_band: Optional[tuple[float, float]] = None) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    segs = _segments(records)
    eval_segs = _segments(records, "eval")
    alerts = [_alert_dict(a) for a in alerts]
    fig = Figure(figsize=(11, 2.1 * len(PANELS) + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    colors = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b")
    for ax, (label, fields, key) in zip(axes, PANELS):
        plotted = False
        panel_segs = eval_segs if key == "eval" else segs
        for si, seg in enumerate(panel_segs):
            xs = [r["iteration"] for r in seg]
            style = "-" if si == len(panel_segs) - 1 else ":"
            for fi, field in enumerate(fields):
                ys = [_num(r.get(field)) for r in seg]
                if all(math.isnan(y) for y in ys):
                    continue
                name = field if len(fields) > 1 or len(panel_segs) > 1 else None
                if name and len(panel_segs) > 1:
                    name = f"{field} (segment {si + 1})"
                ax.plot(xs, ys, style, color=colors[fi % len(colors)], lw=1.4,
                        marker="." if len(xs) < 60 or key == "eval" else None,
                        label=name)
                plotted = True
                if key == "reward":
                    sd = [_num(r.get("reward_std")) for r in seg]
                    lo = [y - s if not math.isnan(s) else math.nan for y, s in zip(ys, sd)]
                    hi = [y + s if not math.isnan(s) else math.nan for y, s in zip(ys, sd)]
                    ax.fill_between(xs, lo, hi, color=colors[fi], alpha=0.2, lw=0)
        if key == "kl" and kl_threshold is not None:
            ax.axhline(kl_threshold, color="#d62728", ls="--", lw=0.8, label=f"threshold {kl_threshold:g}")
        if key == "entropy" and entropy_band is not None:
            ax.axhspan(entropy_band[0], entropy_band[1], color="#2ca02c", alpha=0.08, label="normal band")
        if not plotted:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#999999")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
        for a in alerts:
            st = alert_style(a)
            ax.axvline(a.get("iteration", 0), color=st["color"], ls=st["ls"], lw=st["lw"], ymin=st["ymin"],
                       ymax=st["ymax"])
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, loc="upper left")
    top = axes[0]
    seen: set = set()
    for a in alerts:
        kind = severity_of(a)
        tag = (a.get("rule"), a.get("iteration"), kind)
        if tag in seen:
            continue
        seen.add(tag)
        text = a.get("rule", "?") + (" ✔ collapse" if kind == "confirmed" else "")
        top.annotate(text, xy=(a.get("iteration", 0), 1.02), xycoords=("data", "axes fraction"), rotation=90,
                     fontsize=8 if kind in ("confirmed", "critical") else 6,
                     fontweight="bold" if kind in ("confirmed", "critical") else "normal",
                     va="bottom", ha="center", color=_STYLES[kind]["color"], annotation_clip=False)
    if alerts:  # a key to the markers, with how many of each
        from matplotlib.lines import Line2D

        counts = severity_counts(alerts)
        keys = [Line2D([0], [0], color=st["color"], ls=st["ls"], lw=st["lw"], label=f"{st['label']} ({counts[k]})")
                for k, st in _STYLES.items() if counts[k]]
        fig.legend(handles=keys, loc="upper right", fontsize=8, ncol=len(keys), frameon=False)
    axes[-1].set_xlabel("iteration")
    n_rec = sum(len(s) for s in segs)
    head = title or f"DPCC monitor report: {n_rec} records"
    fig.suptitle(f"{head} ({alert_headline(alerts)})", fontsize=11, x=0.02, ha="left")
    fig.subplots_adjust(left=0.09, right=0.98, top=0.93, bottom=0.04, hspace=0.12)  # tight_layout costs ~1 s
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render_report(records: Sequence[dict], alerts: Sequence[Any], out_path: str | Path, *,
                  title: Optional[str] = None, kl_threshold: Optional[float] = None,
                  entropy_band: Optional[tuple[float, float]] = None) -> Path:
    """Write the report to ``out_path``: PNG, or HTML (embedded PNG + alert table) when it
    ends in ``.html``/``.htm``. ``records``: metric dicts with ``iteration`` (any of the
    record fields); ``alerts``: :class:`Alert` objects or their dicts. Returns the path."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = render_figure_png(records, alerts, title, kl_threshold, entropy_band)
    if out.suffix.lower() not in (".html", ".htm"):
        out.write_bytes(png)
        return out
    rows = []
    for a in (_alert_dict(a) for a in alerts):
        kind = severity_of(a)
        rows.append(f'<tr class="sev-{kind}"><td>{a.get("iteration", "")}</td>'
                    f'<td>{html.escape(str(a.get("rule", "")))}</td>'
                    f'<td>{html.escape(_STYLES[kind]["label"])}</td>'
                    f'<td>{html.escape(str(a.get("message", "")))}</td></tr>')
    heading = html.escape(title or "DPCC monitor report")
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{heading}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}
tr.sev-confirmed td{{background:#f8c9c9;font-weight:bold}} tr.sev-critical td{{background:#fbe3e3}}
tr.sev-warning td{{background:#fff3e0;color:#555}} tr.sev-info td{{color:#777}}</style></head>
<body><h1>{heading}</h1>
<p>{len(records)} records; alerts: {html.escape(alert_headline(alerts))}.</p>
<img alt="metrics over iterations" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Alerts</h2>
<table><tr><th>iteration</th><th>rule</th><th>severity</th><th>message</th></tr>
{''.join(rows) or '<tr><td colspan="4">none</td></tr>'}
</table></body></html>
"""
    out.write_text(doc, encoding="utf-8")
    return out
