"""A profile as a PNG timeline: one row per rank, coloured by kind, idle time by cause.

    plot_timeline(report, "out/timeline.png")            # the last three steady-state steps

Operations are drawn as bars named in the pipelining notation where there is room,
sends as thin bars, idle causes shaded; the legend gives the mean figures over ranks.
Needs matplotlib (the numbers, summary.json and trace.json do not).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from myelin.atomic import write_atomic
from myelin.errors import MyelinError
from myelin.profile.accounting import BUSY_KINDS, COMM_KINDS, Interval
from myelin.profile.records import RankProfiles
from myelin.profile.summary import pct
from myelin.profile.timeline import Span

__all__ = ["MissingMatplotlib", "plot_timeline"]


class MissingMatplotlib(MyelinError, ImportError):
    """The PNG timeline needs matplotlib."""


_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer": "#8172b2",
    "eval": "#64b5cd",
    "kernel": "#4c72b0",
    "cpu_op": "#4c72b0",
    "send": "#222222",
    "bubble": "#f2b8b5",
    "latency": "#c44e52",
    "slow_peer": "#8c613c",
    "sync": "#8172b3",
    "offload_wait": "#f5d76e",
    "collective_wait": "#dd8452",
    "optimizer_host": "#937860",
    "host_wait": "#c7c7c7",
    "short_gap": "#e6e6e6",
    "other": "#da8bc3",
}


_LABELS = {
    "bubble": "bubble (the schedule's)",
    "latency": "message latency",
    "slow_peer": "slow peer",
    "sync": "step-end sync",
    "offload_wait": "offload wait",
    "collective_wait": "collective wait",
    "optimizer_host": "optimizer on host",
    "host_overhead": "host overhead (white)",
    "host_wait": "host wait",
    "short_gap": "short gap",
    "other": "other idle",
}


def _style(span: Span) -> str | None:
    if span.cause is not None:
        return span.cause
    if span.kind in BUSY_KINDS or span.kind in COMM_KINDS:
        return "send" if span.kind in COMM_KINDS else span.kind
    return None


def _step_window(report: RankProfiles, steps: Sequence[int]) -> Interval:
    """The aligned time range from the first record of steps[0] to the last of steps[-1]."""
    base = min(r["wall_origin"] for r in report.ranks)
    lo, hi = float("inf"), float("-inf")
    for rec in report.ranks:
        off = rec["wall_origin"] - base
        for s in report.spans(rec["rank"]):
            if steps[0] <= s.step <= steps[-1]:
                lo, hi = min(lo, off + s.start), max(hi, off + s.end)
    return lo, hi


def plot_timeline(
    report: RankProfiles,
    path: str | os.PathLike[str],
    steps: Sequence[int] | None = None,
    max_steps: int = 3,
) -> Path:
    """A PNG: one row per rank, coloured by kind, idle causes shaded, figures in the legend.

    Draws `steps` (first, last), by default the last `max_steps` steady-state steps.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise MissingMatplotlib(
            "the PNG timeline needs matplotlib: pip install matplotlib (the numbers, "
            "summary.json and trace.json are written without it)"
        ) from exc
    summary = report.summary()
    if steps is None:
        steady = report.steady_steps
        steps = steady[-max_steps:] if steady else []
    if not report.ranks or not steps:
        raise MyelinError("nothing to draw: the profile holds no records")
    lo, hi = _step_window(report, steps)
    if hi <= lo:
        raise MyelinError(f"nothing to draw: no records in steps {steps[0]}-{steps[-1]}")
    n = len(report.ranks)
    fig = Figure(figsize=(12, 1.9 + 0.5 * n), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used = _draw_rows(ax, report, lo, hi)
    ax.set_yticks(range(n), _row_labels(report, summary), fontsize=8 if n > 8 else 9)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    _legend(ax, summary["mean"], used, n, Patch)
    what = f"step {steps[0]}" if steps[0] == steps[-1] else f"steps {steps[0]}-{steps[-1]}"
    ax.set_title(f"{report.source} timeline, {what} (figures: steps {_span(summary)})")
    fig.tight_layout()
    return write_atomic(path, lambda f: fig.savefig(f, format="png"))


def _row_labels(report: RankProfiles, summary: dict[str, Any]) -> list[str]:
    """'rank r (stage s)' over the rank's busy share and its largest idle cause."""
    rows = {r["rank"]: r for r in summary["ranks"]}
    labels = []
    for rec in report.ranks:
        r = rows[rec["rank"]]
        stage = "" if rec.get("stage") is None else f" (stage {rec['stage']})"
        top = max(r["idle"], key=r["idle"].get) if r["idle"] else "idle"
        labels.append(
            f"rank {rec['rank']}{stage}\nbusy {pct(r['busy_frac'])}, "
            f"{top.replace('_', ' ')} {pct(r['idle'].get(top, 0.0))}"
        )
    return labels


def _legend(ax: Any, mean: dict[str, Any], used: set[str], n: int, patch: Any) -> None:
    """Colours of the kinds drawn, and each idle cause with its mean share of wall time."""
    handles = [
        patch(color=_COLOURS[k], label=k) for k in _COLOURS if k in used and k not in _LABELS
    ]
    for cause, frac in mean["idle"].items():
        if cause in used or cause == "host_overhead":
            colour = _COLOURS.get(cause, "white")
            label = f"{_LABELS.get(cause, cause)} {pct(frac)}"
            handles.append(patch(facecolor=colour, edgecolor="#999999", label=label))
    overlap = "" if mean["overlap_frac"] is None else f", overlap {pct(mean['overlap_frac'])}"
    ax.legend(
        handles=handles,
        title=f"mean of {n} ranks: busy {pct(mean['busy_frac'])}{overlap}",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title_fontsize=8,
        frameon=False,
    )


def _span(summary: dict[str, Any]) -> str:
    steps = summary["steady_steps"]
    return f"{steps[0]}-{steps[1]}" if steps else "-"


def _draw_rows(ax: Any, report: RankProfiles, lo: float, hi: float) -> set[str]:
    """Bars for every record inside [lo, hi], operations named where there is room."""
    base = min(r["wall_origin"] for r in report.ranks)
    used: set[str] = set()
    for row, rec in enumerate(report.ranks):
        off = rec["wall_origin"] - base
        bars: dict[str, list[Interval]] = {}
        names: list[tuple[float, float, str]] = []
        for s in report.spans(rec["rank"]):
            style = _style(s)
            a, b = max(off + s.start, lo), min(off + s.end, hi)
            if style is not None and b > a:
                bars.setdefault(style, []).append((a - lo, b - a))
                if style in BUSY_KINDS:
                    names.append((a - lo, b - a, s.name))
        thin = sum(map(len, bars.values())) > 2000  # edges would hide the bars
        for style, xs in bars.items():
            used.add(style)
            colour = _COLOURS.get(style, "#999999")
            if style == "send":
                ax.broken_barh(xs, (row + 0.28, 0.12), facecolors=colour)
            elif style in BUSY_KINDS:
                edge = "none" if thin else "white"
                ax.broken_barh(xs, (row - 0.4, 0.68), facecolors=colour, edgecolor=edge, lw=0.5)
            else:
                ax.broken_barh(xs, (row - 0.3, 0.5), facecolors=colour, edgecolor="none")
        room = 0.025 * (hi - lo)
        if len(names) <= 400:
            for x, w, name in names:
                if w >= room:
                    ax.text(x + w / 2, row - 0.06, name, ha="center", va="center", fontsize=6,
                            color="white", clip_on=True)  # fmt: skip
    return used
