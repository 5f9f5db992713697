"""Where every rank's time went: idle causes as numbers, a Perfetto trace and a picture.

    report = ProfileReport.from_ranks([collect(timeline) for each rank])
    report.print()                 # one row per rank: busy, idle by cause, overlap
    report.save("out/")            # summary.json, trace.json, timeline.png, ranks/rank{r}.json
    myelin profile out/            # the table again, and the picture redrawn

A rank's wall time (from its first record of a step to its last) is split into disjoint
parts that add up to 100%: busy (forward, backward, optimizer, evaluation, GPU kernels)
and idle by cause, each the time covered by waits of that cause and by nothing before
it in `CAUSES`: bubble (no operation ready, waiting for a message), offload wait,
collective wait (all-reduce), optimizer on the host; for torch.profiler traces also
HTA's host wait, short gap and other; what no record covers is host overhead. Figures
are given over the steady-state steps (after `warmup_steps`) and over the whole run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import zlib
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from myelin.errors import ConfigError, MyelinError
from myelin.profile.timeline import IDLE_CAUSES, KINDS, Span

__all__ = [
    "CAUSES",
    "ProfileConfig",
    "ProfileReport",
    "account",
    "add_arguments",
    "chrome_trace",
    "collect",
    "finish_profile",
    "gather",
    "gather_report",
    "load",
    "main",
    "plot_timeline",
]

log = logging.getLogger(__name__)

RANK_FORMAT = "myelin-profile-rank"
SUMMARY_FORMAT = "myelin-profile-summary"
SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(Span))
HTA_CAUSES = ("host_wait", "short_gap", "other")
# Idle causes in the order they claim time; host overhead is what none claims.
CAUSES = ("bubble", "offload_wait", "collective_wait", "optimizer_host", *HTA_CAUSES)
BUSY_KINDS = frozenset(
    {k for k, g in KINDS.items() if g == "compute"} | {"kernel", "memcpy", "memset", "cpu_op"}
)
COMM_KINDS = frozenset({"send", "recv", "collective"})

Interval = tuple[float, float]

# -- what one rank recorded, as plain data -------------------------------------------------


def collect(
    timeline: Any,
    counters: dict[str, list[list[float]]] | None = None,
    *,
    device: Any = None,
    replica: int | None = None,
) -> dict[str, Any]:
    """One rank's timeline (and sampled counters) as JSON-ready data, for a report."""
    spans = timeline.spans
    return {
        "format": RANK_FORMAT,
        "version": 1,
        "source": "myelin",
        "rank": timeline.rank,
        "stage": timeline.stage,
        "replica": replica,
        "device": None if device is None else str(device),
        "wall_origin": timeline.wall_origin,
        "span_fields": list(SPAN_FIELDS),
        "spans": [[getattr(s, f) for f in SPAN_FIELDS] for s in spans],
        "counters": dict(counters or {}),
        "detail": {},
    }


def spans_of(record: dict[str, Any]) -> list[Span]:
    """The spans of a rank record (fields it names that Span lacks are dropped)."""
    fields = record.get("span_fields", SPAN_FIELDS)
    keep = [i for i, f in enumerate(fields) if f in SPAN_FIELDS]
    return [Span(**{fields[i]: row[i] for i in keep}) for row in record["spans"]]


# -- intervals: sorted, disjoint lists of (start, end) ----------------------------------------


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as `intervals` (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _subtract(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """Parts of merged `xs` not covered by merged `ys`."""
    out, j = [], 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > a:
                out.append((a, ys[k][0]))
            a = max(a, ys[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def _total(xs: Iterable[Interval]) -> float:
    return sum(b - a for a, b in xs)


def _intersect_total(xs: list[Interval], ys: list[Interval]) -> float:
    return _total(xs) - _total(_subtract(xs, ys))


# -- idle accounting -----------------------------------------------------------------------


def account(
    spans: Sequence[Span],
    start: float,
    end: float,
    host_device: bool = False,
    hta: bool = False,
) -> dict[str, Any]:
    """Busy fraction, idle by cause and comm/compute overlap of one rank in [start, end].

    host_device: the loop's own thread is the device (CPU), so time it spends in a send
    or receive is not compute even where the record of an operation encloses it.
    hta: always report HTA's causes (an imported trace), not only those that occur.
    """
    wall = max(end - start, 0.0)

    def clipped(keep: Any) -> list[Interval]:
        return merge_intervals((max(s.start, start), min(s.end, end)) for s in spans if keep(s))

    busy = clipped(lambda s: s.cause is None and s.kind in BUSY_KINDS)
    loop_comm = clipped(lambda s: s.kind in ("send", "recv"))
    if host_device:
        busy = _subtract(busy, loop_comm)
    covered, seconds = busy, {}
    extra = sorted({s.cause for s in spans if s.cause and s.cause not in CAUSES})
    for cause in (*CAUSES, *extra):
        own = _subtract(clipped(lambda s, c=cause: s.cause == c), covered)
        if own or hta or cause not in HTA_CAUSES:
            seconds[cause] = _total(own)
            covered = merge_intervals(covered + own)
    seconds["host_overhead"] = max(wall - _total(covered), 0.0)
    comm = clipped(lambda s: s.kind in COMM_KINDS)
    comm_s = _total(comm)
    idle = {c: seconds.pop(c) for c in IDLE_CAUSES}
    idle.update(seconds)
    return {
        "wall_s": wall,
        "busy_frac": _frac(_total(busy), wall),
        "idle": {c: _frac(v, wall) for c, v in idle.items()},
        "overlap_frac": _intersect_total(comm, busy) / comm_s if comm_s else None,
        "comm_s": comm_s,
        # of host overhead: the loop handing messages over, not hidden behind compute
        "exposed_send_frac": _frac(_total(_subtract(loop_comm, covered)), wall),
    }


def _frac(x: float, wall: float) -> float:
    return x / wall if wall > 0 else 0.0


def _window(spans: Sequence[Span], first_step: int | None = None) -> Interval | None:
    """From the first record of `first_step` (or of anything) on to the last record."""
    chosen = [s for s in spans if first_step is None or s.step >= first_step]
    if not chosen:
        return None
    return min(s.start for s in chosen), max(s.end for s in chosen)


# -- the report ------------------------------------------------------------------------------


class ProfileReport:
    """Every rank's records and the figures derived from them."""

    def __init__(
        self,
        ranks: Sequence[dict[str, Any]],
        warmup_steps: int = 1,
        missing: Sequence[int] = (),
    ) -> None:
        if type(warmup_steps) is not int or warmup_steps < 0:
            raise ConfigError(f"warmup_steps={warmup_steps!r} must be an int >= 0")
        seen = [r["rank"] for r in ranks]
        if len(set(seen)) != len(seen):
            raise MyelinError(f"a profile holds each rank once, got ranks {sorted(seen)}")
        self.ranks = sorted(ranks, key=lambda r: r["rank"])
        self.warmup_steps = warmup_steps
        self.missing = sorted(missing)
        self._spans = {r["rank"]: spans_of(r) for r in self.ranks}
        self._summary: dict[str, Any] | None = None

    @classmethod
    def from_ranks(
        cls, ranks: Sequence[dict[str, Any]], warmup_steps: int = 1, missing: Sequence[int] = ()
    ) -> ProfileReport:
        """A report of rank records (from `collect` or the torch.profiler import)."""
        return cls(ranks, warmup_steps, missing)

    @property
    def source(self) -> str:
        return self.ranks[0].get("source", "myelin") if self.ranks else "myelin"

    def spans(self, rank: int) -> list[Span]:
        return self._spans[rank]

    @property
    def steps(self) -> list[int]:
        """Every step number any rank recorded, in order."""
        return sorted({s.step for spans in self._spans.values() for s in spans})

    @property
    def steady_steps(self) -> list[int]:
        """The steps after warm-up (all steps when there are no more than `warmup_steps`)."""
        steps = self.steps
        return steps[self.warmup_steps :] if len(steps) > self.warmup_steps else steps

    def summary(self) -> dict[str, Any]:
        """The figures, shaped as summary.json: {"ranks": [{rank, stage, wall_s, ...}], ...}."""
        if self._summary is None:
            self._summary = self._build_summary()
        return self._summary

    def _build_summary(self) -> dict[str, Any]:
        steady = self.steady_steps
        rows = []
        for rec in self.ranks:
            spans = self._spans[rec["rank"]]
            row = {k: rec.get(k) for k in ("rank", "stage", "replica", "device", "source")}
            mine = rec.get("source", "myelin") == "myelin"
            how = {"host_device": mine and _on_host(rec.get("device")), "hta": not mine}
            window = _window(spans, steady[0] if steady else None) or (0.0, 0.0)
            row.update(account(spans, *window, **how))
            row["steps"] = [steady[0], steady[-1]] if steady else []
            whole = _window(spans) or (0.0, 0.0)
            row["whole_run"] = account(spans, *whole, **how)
            if rec.get("detail"):
                row["detail"] = rec["detail"]
            rows.append(row)
        return {
            "format": SUMMARY_FORMAT,
            "version": 1,
            "source": self.source,
            "world_size": len(self.ranks) + len(self.missing),
            "missing_ranks": self.missing,
            "warmup_steps": self.warmup_steps,
            "steps": [self.steps[0], self.steps[-1]] if self.steps else [],
            "steady_steps": [steady[0], steady[-1]] if steady else [],
            "ranks": rows,
            "mean": _mean(rows),
        }

    def format(self) -> str:
        """The summary as a plain-text table, one row per rank."""
        return format_summary(self.summary())

    def print(self, file: TextIO | None = None) -> None:
        print(self.format(), file=file or sys.stdout)

    def trace(self) -> dict[str, Any]:
        """The Chrome trace (Trace Event Format) that Perfetto and chrome://tracing open."""
        return chrome_trace(self)

    def plot(self, path: str | os.PathLike[str], steps: Sequence[int] | None = None) -> Path:
        """Draw the PNG timeline; needs matplotlib."""
        return plot_timeline(self, path, steps)

    def save(self, out_dir: str | os.PathLike[str], plot: bool = True) -> dict[str, Path]:
        """Write summary.json, trace.json, timeline.png and ranks/rank{r}.json under `out_dir`."""
        out = Path(out_dir)
        (out / "ranks").mkdir(parents=True, exist_ok=True)
        paths = {}
        for rec in self.ranks:
            paths[f"rank{rec['rank']}"] = _write_json(
                out / "ranks" / f"rank{rec['rank']}.json", rec
            )
        paths["summary"] = _write_json(out / "summary.json", self.summary(), indent=1)
        paths["trace"] = _write_json(out / "trace.json", self.trace())
        if plot:
            try:
                paths["timeline"] = self.plot(out / "timeline.png")
            except MissingMatplotlib as exc:
                log.warning("%s", exc)
        return paths


def _on_host(device: str | None) -> bool:
    """Whether records of this device are host times (CPU) rather than device times."""
    return device is None or not str(device).startswith("cuda")


def _write_json(path: Path, data: Any, indent: int | None = None) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, separators=None if indent else (",", ":")))
    tmp.replace(path)
    return path


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {}
    keys = list(dict.fromkeys(k for r in rows for k in r["idle"]))
    overlaps = [r["overlap_frac"] for r in rows if r["overlap_frac"] is not None]
    return {
        "wall_s": sum(r["wall_s"] for r in rows) / len(rows),
        "busy_frac": sum(r["busy_frac"] for r in rows) / len(rows),
        "idle": {k: sum(r["idle"].get(k, 0.0) for r in rows) / len(rows) for k in keys},
        "overlap_frac": sum(overlaps) / len(overlaps) if overlaps else None,
    }


def load(path: str | os.PathLike[str], warmup_steps: int | None = None) -> ProfileReport:
    """Read back a profile directory written by `ProfileReport.save` (or its summary.json)."""
    root = Path(path)
    if root.is_file():
        root = root.parent
    files = sorted((root / "ranks").glob("rank*.json"))
    if not files:
        raise MyelinError(f"{root} holds no ranks/rank*.json: not a myelin profile directory")
    records = [json.loads(f.read_text()) for f in files]
    for f, rec in zip(files, records):
        if rec.get("format") != RANK_FORMAT:
            raise MyelinError(f"{f} is not a myelin rank profile (format={rec.get('format')!r})")
    summary = root / "summary.json"
    saved = json.loads(summary.read_text()) if summary.exists() else {}
    if warmup_steps is None:
        warmup_steps = saved.get("warmup_steps", 1)
    return ProfileReport(records, warmup_steps, saved.get("missing_ranks", ()))


# -- the table -----------------------------------------------------------------------------

_SHORT = {
    "bubble": "bubble",
    "offload_wait": "offload",
    "collective_wait": "collect.",
    "optimizer_host": "opt-host",
    "host_overhead": "host",
    "host_wait": "host-wait",
    "short_gap": "short-gap",
    "other": "other",
}


def format_summary(summary: dict[str, Any]) -> str:
    """summary.json as a table: per rank, busy and idle causes in % of its wall time."""
    rows = summary["ranks"]
    keys = list(dict.fromkeys(k for r in rows for k in r["idle"]))
    if summary["source"] != "myelin":  # causes that no record of an imported trace can have
        keys = [k for k in keys if any(r["idle"][k] for r in rows) or k in HTA_CAUSES]
    head = ["rank", "stage", "wall s", "busy", *(_SHORT.get(k, k) for k in keys), "overlap"]

    def line(r: dict[str, Any], label: str) -> list[str]:
        cells = [label, "-" if r.get("stage") is None else str(r["stage"]), f"{r['wall_s']:.3f}"]
        cells += [_pct(r["busy_frac"])] + [_pct(r["idle"].get(k, 0.0)) for k in keys]
        return cells + ["-" if r["overlap_frac"] is None else _pct(r["overlap_frac"])]

    table = [head] + [line(r, str(r["rank"])) for r in rows]
    if len(rows) > 1:
        table.append(line(summary["mean"], "mean"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    text = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    steps = summary["steady_steps"]
    title = f"{summary['source']} profile: {len(rows)} rank(s), % of each rank's wall time"
    if steps:
        title += f" over steps {steps[0]}-{steps[1]}"
        if summary["warmup_steps"] and summary["steps"] and summary["steps"][0] < steps[0]:
            title += f" (after {summary['warmup_steps']} warm-up)"
    if summary.get("missing_ranks"):
        title += f"; ranks {summary['missing_ranks']} sent no records"
    return "\n".join([title, *text])


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# -- the Chrome trace ----------------------------------------------------------------------

_TRACK_ORDER = ("compute", "stream", "wait", "idle", "collective", "offload", "peer", "myelin")


def _track_key(track: str) -> tuple[int, str]:
    for i, prefix in enumerate(_TRACK_ORDER):
        if track.startswith(prefix):
            return i, track
    return len(_TRACK_ORDER), track


def _lanes(spans: Sequence[Span]) -> list[str]:
    """A lane per span: its track, or "track (2)"... where spans of one track overlap."""
    out = [""] * len(spans)
    ends: dict[str, list[float]] = {}
    for i in sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end)):
        s = spans[i]
        lanes = ends.setdefault(s.track, [])
        k = next((k for k, end in enumerate(lanes) if end <= s.start), len(lanes))
        if k == len(lanes):
            lanes.append(s.end)
        lanes[k] = s.end
        out[i] = s.track if k == 0 else f"{s.track} ({k + 1})"
    return out


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def chrome_trace(report: ProfileReport) -> dict[str, Any]:
    """Trace Event Format: a process per rank, a thread per track, flows from sends."""
    base = min((r["wall_origin"] for r in report.ranks), default=0.0)
    events: list[dict[str, Any]] = []
    placed: dict[int, list[tuple[Span, int, float]]] = {}  # rank -> (span, tid, offset)
    for rec in report.ranks:
        pid, offset = rec["rank"], rec["wall_origin"] - base
        spans = report.spans(pid)
        lanes = _lanes(spans)
        tids = {name: i + 1 for i, name in enumerate(sorted(set(lanes), key=_track_key))}
        stage = "" if rec.get("stage") is None else f" (stage {rec['stage']})"
        events += [
            _meta("process_name", pid, 0, name=f"rank {pid}{stage}"),
            _meta("process_sort_index", pid, 0, sort_index=pid),
        ]
        for name, tid in tids.items():
            events.append(_meta("thread_name", pid, tid, name=name))
            events.append(_meta("thread_sort_index", pid, tid, sort_index=tid))
        placed[pid] = []
        for span, lane in zip(spans, lanes):
            tid = tids[lane]
            events.append(_slice(span, pid, tid, offset))
            placed[pid].append((span, tid, offset))
        for name, samples in rec.get("counters", {}).items():
            key = name.split(" ")[-1]
            for t, value in samples:
                ts = _us(offset + t)
                events.append({"ph": "C", "name": name, "pid": pid, "ts": ts, "args": {key: value}})
    events += _flows(placed)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "myelin", "source": report.source, "wall_origin": base},
    }


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "ts": 0, "args": args}


def _slice(span: Span, pid: int, tid: int, offset: float) -> dict[str, Any]:
    ts, end = _us(offset + span.start), _us(offset + span.end)
    args = {"step": span.step}
    for key in ("microbatch", "cause", "peer"):
        if getattr(span, key) is not None:
            args[key] = getattr(span, key)
    if span.nbytes:
        args["nbytes"] = span.nbytes
    return {
        "ph": "X",
        "name": span.name,
        "cat": span.kind,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": round(max(end - ts, 0.0), 3),
        "args": args,
    }


def _flows(placed: dict[int, list[tuple[Span, int, float]]]) -> list[dict[str, Any]]:
    """An arrow from each send to the forward or backward it made ready on its peer."""
    targets = {}
    for rank, items in placed.items():
        for span, tid, offset in items:
            letter = "F" if span.kind in ("forward", "eval") else "B"
            if span.kind in ("forward", "eval", "backward") and span.microbatch is not None:
                targets.setdefault((rank, letter, span.step, span.microbatch), (span, tid, offset))
    events, flow_id = [], 0
    for rank, items in placed.items():
        for span, tid, offset in items:
            if span.kind != "send" or span.peer is None or "SEND_" not in span.name:
                continue
            letter = span.name.split("SEND_", 1)[1][:1]
            hit = targets.get((span.peer, letter, span.step, span.microbatch))
            if hit is None:
                continue
            flow_id += 1
            dst, dst_tid, dst_offset = hit
            common = {"name": "message", "cat": "flow", "id": flow_id}
            start = _us(offset + span.start)  # the message may arrive before send returns
            end = _us(dst_offset + dst.start) + min(_us(dst.end - dst.start) / 2, 1.0)
            events.append({"ph": "s", "pid": rank, "tid": tid, "ts": start, **common})
            events.append(
                {"ph": "f", "bp": "e", "pid": span.peer, "tid": dst_tid, "ts": end, **common}
            )
    return events


# -- the picture -----------------------------------------------------------------------------


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
    "offload_wait": "#f5d76e",
    "collective_wait": "#dd8452",
    "optimizer_host": "#937860",
    "host_wait": "#c7c7c7",
    "short_gap": "#e6e6e6",
    "other": "#da8bc3",
}
_LABELS = {
    "bubble": "bubble (waiting for a message)",
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


def _step_window(report: ProfileReport, steps: Sequence[int]) -> Interval:
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
    report: ProfileReport,
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
    out = Path(path)
    fig.savefig(out)
    return out


def _row_labels(report: ProfileReport, summary: dict[str, Any]) -> list[str]:
    """'rank r (stage s)' over the rank's busy share and its largest idle cause."""
    rows = {r["rank"]: r for r in summary["ranks"]}
    labels = []
    for rec in report.ranks:
        r = rows[rec["rank"]]
        stage = "" if rec.get("stage") is None else f" (stage {rec['stage']})"
        top = max(r["idle"], key=r["idle"].get) if r["idle"] else "idle"
        labels.append(
            f"rank {rec['rank']}{stage}\nbusy {_pct(r['busy_frac'])}, "
            f"{top.replace('_', ' ')} {_pct(r['idle'].get(top, 0.0))}"
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
            label = f"{_LABELS.get(cause, cause)} {_pct(frac)}"
            handles.append(patch(facecolor=colour, edgecolor="#999999", label=label))
    overlap = "" if mean["overlap_frac"] is None else f", overlap {_pct(mean['overlap_frac'])}"
    ax.legend(
        handles=handles,
        title=f"mean of {n} ranks: busy {_pct(mean['busy_frac'])}{overlap}",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title_fontsize=8,
        frameon=False,
    )


def _span(summary: dict[str, Any]) -> str:
    steps = summary["steady_steps"]
    return f"{steps[0]}-{steps[1]}" if steps else "-"


def _draw_rows(ax: Any, report: ProfileReport, lo: float, hi: float) -> set[str]:
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


# -- every rank's records, gathered without pickle -------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    """What `Trainer(profile=...)` records and where the report goes.

    out_dir: where close() writes summary.json, trace.json, timeline.png (None: print only).
    interval_s: how often NVML and memory counters are sampled, in seconds.
    warmup_steps: steps left out of the steady-state figures.
    gather_timeout_s: how long rank 0 waits for the other ranks' records at close.
    print_summary: print the table on rank 0 at close.
    """

    out_dir: str | None = None
    interval_s: float = 0.1
    warmup_steps: int = 1
    gather_timeout_s: float = 60.0
    print_summary: bool = True

    def __post_init__(self) -> None:
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise ConfigError(f"profile out_dir={self.out_dir!r} must be a path")
        if self.out_dir is not None:
            object.__setattr__(self, "out_dir", os.fspath(self.out_dir))
            if not self.out_dir:
                raise ConfigError("profile out_dir='' must name a directory (or be None)")
        if type(self.print_summary) is not bool:
            raise ConfigError(f"profile print_summary={self.print_summary!r} must be True/False")
        for name, lo, hi in (("interval_s", 0.001, 60.0), ("gather_timeout_s", 0.1, 3600.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"profile {name}={value!r} must be a number of seconds")
            if not lo <= value <= hi:
                raise ConfigError(f"profile {name}={value!r} must be in [{lo}, {hi}] seconds")
        if type(self.warmup_steps) is not int or self.warmup_steps < 0:
            raise ConfigError(f"profile warmup_steps={self.warmup_steps!r} must be an int >= 0")

    @staticmethod
    def from_arg(profile: Any) -> ProfileConfig | None:
        """`Trainer(profile=...)`: False/None, True, an output directory, or a ProfileConfig."""
        if profile is None or profile is False:
            return None
        if profile is True:
            return ProfileConfig()
        if isinstance(profile, ProfileConfig):
            return profile
        if isinstance(profile, (str, os.PathLike)):
            return ProfileConfig(out_dir=os.fspath(profile))
        raise ConfigError(
            f"profile={profile!r} must be True, an output directory, or a myelin ProfileConfig"
        )


def gather(
    record: dict[str, Any], world: Any, timeout_s: float = 60.0
) -> tuple[list[dict[str, Any]], list[int]]:
    """Every rank's record on every rank, through the torch.distributed store as JSON.

    Collective: every rank calls it. Returns the records and the ranks that sent none
    within `timeout_s` (a dead peer costs a timeout, never a hang).
    """
    size = world.layout.world_size
    if size == 1 or world.store is None:
        return [record], []
    store = world.store
    call = store.add(f"myelin/profile/calls/{world.rank}", 1)  # the same on every rank
    prefix = f"myelin/profile/{call}"
    store.set(f"{prefix}/{world.rank}", zlib.compress(json.dumps(record).encode(), 1))
    keys = [f"{prefix}/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError on timeout: take what came
        pass
    records, missing = [], []
    for r, key in enumerate(keys):
        if r == world.rank:
            records.append(record)
        elif store.check([key]):
            records.append(json.loads(zlib.decompress(store.get(key))))
        else:
            missing.append(r)
    if missing:
        log.warning("rank %d: no profile records from ranks %s", world.rank, missing)
    if store.add(f"{prefix}/read", 1) == size:  # the last reader cleans up
        for key in [*keys, f"{prefix}/read"]:
            store.delete_key(key)
    return records, missing


def gather_report(
    timeline: Any,
    world: Any,
    sampler: Any = None,
    config: ProfileConfig | None = None,
) -> ProfileReport:
    """Every rank's profile so far, as one report on every rank (collective)."""
    config = config or ProfileConfig()
    counters = sampler.counters if sampler is not None else None
    record = collect(
        timeline, counters, device=getattr(world, "device", None), replica=world.replica
    )
    records, missing = gather(record, world, config.gather_timeout_s)
    return ProfileReport.from_ranks(records, config.warmup_steps, missing)


def finish_profile(
    timeline: Any,
    world: Any,
    sampler: Any = None,
    config: ProfileConfig | None = None,
    failed: bool = False,
) -> ProfileReport | None:
    """At close: stop sampling, gather, and on rank 0 print and save the report.

    After a failure (`failed`) peers may be gone, so each rank saves only its own
    records. Never raises: a profile must not turn a clean close into an error.
    """
    config = config or ProfileConfig()
    try:
        if sampler is not None:
            sampler.stop()
        if failed:
            record = collect(timeline, sampler.counters if sampler is not None else None)
            report = ProfileReport.from_ranks([record], config.warmup_steps)
            if config.out_dir is not None:
                path = Path(config.out_dir) / "ranks" / f"rank{world.rank}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                _write_json(path, record)
            return report
        report = gather_report(timeline, world, sampler, config)
        if world.rank == 0:
            if config.print_summary:
                report.print()
            if config.out_dir is not None:
                report.save(config.out_dir)
                log.info("profile written to %s", config.out_dir)
        return report
    except Exception as exc:
        log.warning("rank %d: could not finish the profile: %s", world.rank, exc, exc_info=True)
        return None


# -- `myelin profile` ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `myelin profile PATH...`."""
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a profile directory written by myelin, or torch.profiler trace files "
        "(.json or .json.gz, one per rank) or a directory of them",
    )
    parser.add_argument(
        "--out",
        help="write summary.json, trace.json and timeline.png here (default: a myelin "
        "profile directory is redrawn in place; an imported trace writes nothing)",
    )
    parser.add_argument("--steps", help="draw these steps, e.g. '3' or '2-4' (default: last 3)")
    parser.add_argument(
        "--warmup-steps", type=_count, help="steps left out of the steady-state figures"
    )
    parser.add_argument(
        "--short-gap-us",
        type=_microseconds,
        default=0.03,
        help="torch traces: idle gaps shorter than this are 'short gaps' (HTA: 30 ns)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw timeline.png")
    parser.add_argument("--json", action="store_true", help="print summary.json, not a table")
    return parser


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an int in [0, 1000000]")
    return int(text)


def _microseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of microseconds in [0, 1e9]")
    return value


def main(args: argparse.Namespace) -> int:
    """Run `myelin profile`: print the figures, redraw or write the files; exit status."""
    try:
        steps = _parse_steps(args.steps)  # a bad flag fails before anything is printed
        report, here = _open(args)
        print(json.dumps(report.summary(), indent=1) if args.json else report.format())
        out = Path(args.out) if args.out else here
        if args.out:
            report.save(out, plot=False)
        if out is not None and not args.no_plot:
            print(f"drew {report.plot(out / 'timeline.png', steps)}", file=sys.stderr)
    except (MyelinError, OSError, ValueError) as exc:
        print(f"myelin profile: {exc}", file=sys.stderr)
        return 2
    return 0


def _open(args: argparse.Namespace) -> tuple[ProfileReport, Path | None]:
    """The report PATH holds, and the directory to redraw in place (None for torch traces)."""
    paths = [Path(p) for p in args.paths]
    if len(paths) == 1 and (paths[0] / "ranks").is_dir():
        return load(paths[0], args.warmup_steps), paths[0]
    from myelin.profile.torch_trace import load_traces

    records = load_traces(paths, short_gap_us=args.short_gap_us)
    warmup = 0 if args.warmup_steps is None else args.warmup_steps
    return ProfileReport.from_ranks(records, warmup), None


def _parse_steps(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        parts = [int(p) for p in text.split("-", 1)]
    except ValueError:
        raise MyelinError(f"--steps {text!r} must be a step or a range such as 2-4") from None
    if parts[-1] < parts[0]:
        raise MyelinError(f"--steps {text!r}: the range ends before it starts")
    return [parts[0], parts[-1]]


if __name__ == "__main__":
    sys.exit(main(add_arguments(argparse.ArgumentParser(prog="myelin profile")).parse_args()))
