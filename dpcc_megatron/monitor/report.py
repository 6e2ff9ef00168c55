"""Training report: entropy, KL, tau_t, LR factor, reward, held-out eval reward, repetition and
sampler/trainer mismatch over iterations, with alert markers. PNG, or HTML embedding the PNG.

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
    ("KL", ("kl_old_new", "kl_ref"), "kl"),
    ("DPCC τ_t", ("tau",), "tau"),
    ("LR factor", ("lr_factor",), "lr_factor"),
    ("Reward (mean ± std)", ("reward_mean",), "reward"),
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
            ax.axvline(a.get("iteration", 0), color=_SEV_COLOR.get(a.get("severity"), "#7f7f7f"),
                       lw=1.6 if a.get("confirmed") else 0.9, ls="-" if a.get("confirmed") else "--", alpha=0.8)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, loc="upper left")
    top = axes[0]
    seen: set = set()
    for a in alerts:
        tag = (a.get("rule"), a.get("iteration"))
        if tag in seen:
            continue
        seen.add(tag)
        text = a.get("rule", "?") + (" ✔" if a.get("confirmed") else "")
        top.annotate(text, xy=(a.get("iteration", 0), 1.02), xycoords=("data", "axes fraction"), rotation=90,
                     fontsize=7, va="bottom", ha="center", color=_SEV_COLOR.get(a.get("severity"), "#7f7f7f"),
                     annotation_clip=False)
    axes[-1].set_xlabel("iteration")
    n_rec = sum(len(s) for s in segs)
    fig.suptitle(title or f"DPCC monitor report: {n_rec} records, {len(alerts)} alerts", fontsize=11)
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
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(a.get(k, '')))}</td>" for k in
                                     ("iteration", "rule", "severity", "confirmed", "message")) + "</tr>")
    heading = html.escape(title or "DPCC monitor report")
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{heading}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}</style></head>
<body><h1>{heading}</h1>
<p>{len(records)} records, {len(alerts)} alerts.</p>
<img alt="metrics over iterations" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Alerts</h2>
<table><tr><th>iteration</th><th>rule</th><th>severity</th><th>confirmed</th><th>message</th></tr>
{''.join(rows) or '<tr><td colspan="5">none</td></tr>'}
</table></body></html>
"""
    out.write_text(doc, encoding="utf-8")
    return out
