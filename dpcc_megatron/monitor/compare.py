"""Side-by-side report of runs of several methods on one job: reward, entropy, KL, τ and the LR
factor per iteration for each method in one figure, each run's collapse (by the labelling rule,
:mod:`dpcc_megatron.monitor.labels`) and the monitor's first confirmed critical marked, and the
held-out greedy reward before and after RL.

matplotlib is imported lazily (object-oriented API, Agg canvas), as in :mod:`.report`.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

#: (panel title, record fields tried in order: the first present is drawn).
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("Reward, rule track (sampled)", ("reward_base_mean", "reward_mean")),
    ("Token entropy (nats)", ("entropy",)),
    ("KL(π_old‖π_θ), largest step", ("kl_step_max", "kl_old_new")),
    ("Ratio threshold τ_t", ("tau",)),
    ("LR factor (DPCC's drift-aware LR)", ("lr_factor",)),
]
_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")


@dataclass
class MethodRun:
    """One method's run: its training records, the labelling rule's verdict and the monitor's first
    confirmed critical (iteration, rule), if any. ``fixed``: panels' fields that the method does not
    adapt, with their constant value (GRPO's ratio bound 1 + ε for ``tau``), drawn as a flat line
    instead of the recorded series."""

    name: str
    records: list[dict]
    reward_before: Optional[float] = None
    reward_after: Optional[float] = None
    collapse_onset: Optional[int] = None
    collapsed: bool = False
    first_critical: Optional[tuple[int, str]] = None
    fixed: dict = field(default_factory=dict)


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _series(records: list[dict], fields: tuple[str, ...]) -> tuple[list[int], list[float]]:
    for f in fields:
        if any(isinstance(r.get(f), (int, float)) for r in records):
            return [int(r["iteration"]) for r in records], [_num(r.get(f)) for r in records]
    return [], []


def render_comparison_png(runs: list[MethodRun], title: str) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 7.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    for ax, (label, fields) in zip(axes, PANELS):
        drawn = False
        for i, run in enumerate(runs):
            color = _COLORS[i % len(_COLORS)]
            fixed = next((run.fixed[f] for f in fields if f in run.fixed), None)
            if fixed is not None:
                ax.axhline(fixed, color=color, lw=1.5, label=f"{run.name} (fixed: {fixed:g})")
                drawn = True
                continue
            xs, ys = _series(run.records, fields)
            if not xs or all(math.isnan(y) for y in ys):
                continue
            ax.plot(xs, ys, "-", marker=".", color=color, lw=1.5, label=run.name)
            drawn = True
            if run.collapsed and run.collapse_onset is not None:
                ax.axvline(run.collapse_onset, color=color, ls="-", lw=2.2, alpha=0.7)
            if run.first_critical is not None:
                ax.axvline(run.first_critical[0], color=color, ls="--", lw=1.0)
        if not drawn:
            ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", va="center", color="#999999")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
        if drawn:
            ax.legend(fontsize=7, loc="best")
    ax = axes[len(PANELS)]  # held-out greedy reward before and after RL
    width = 0.38
    for i, run in enumerate(runs):
        color = _COLORS[i % len(_COLORS)]
        vals = [_num(run.reward_before), _num(run.reward_after)]
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(2)]
        ax.bar(xs, [0 if math.isnan(v) else v for v in vals], width, color=color, alpha=0.8, label=run.name)
        for x, v in zip(xs, vals):
            if not math.isnan(v):
                ax.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0, 1], ["after warm-start", "after RL"], fontsize=8)
    ax.set_title("Held-out greedy reward", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    verdicts = "; ".join(
        f"{r.name}: " + (f"collapsed at iteration {r.collapse_onset}" if r.collapsed else "no collapse")
        + (f", monitor critical ({r.first_critical[1]}) at {r.first_critical[0]}" if r.first_critical else "")
        for r in runs)
    fig.suptitle(f"{title}\n{verdicts}", fontsize=10, x=0.02, ha="left")
    fig.text(0.99, 0.005, "solid vertical line: collapse onset (labelling rule); dashed: the monitor's first "
             "confirmed critical", ha="right", fontsize=7, color="#555555")
    fig.subplots_adjust(left=0.05, right=0.99, top=0.88, bottom=0.08, hspace=0.38, wspace=0.2)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render_comparison(runs: list[MethodRun], out_path: str | Path, title: str) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(render_comparison_png(runs, title))
    return out
