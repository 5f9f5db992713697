"""A profile as a Chrome trace (Trace Event Format) that Perfetto and chrome://tracing open.

One process per rank named `rank r (stage s)`, one thread per track (`compute`, `wait`,
`collective`, `peer 1`...; overlapping spans of one track get lanes of their own),
operations named in torch.distributed.pipelining's notation, arrows from each send to
the operation it made ready on its peer, and sampled counters as counter tracks. Ranks
are placed on one clock by their wall-clock origin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from myelin.profile.records import RankProfiles
from myelin.profile.timeline import Span

__all__ = ["chrome_trace"]

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


def chrome_trace(report: RankProfiles) -> dict[str, Any]:
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
