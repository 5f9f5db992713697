"""A rank's profile as plain data: the record every report, trace and picture is made from.

    record = collect(timeline, sampler.counters, device=device, replica=replica)

A record is JSON-ready (`format: myelin-profile-rank`): the rank, its stage and device,
the wall-clock origin that lines ranks up, its spans as rows of `SPAN_FIELDS`, sampled
counters, and free-form `detail`. Records travel between ranks as JSON (never pickled),
are written to `ranks/rank{r}.json`, and come from torch.profiler traces too.
`RankProfiles` is what the views of a profile (trace, picture) read of a report.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path
from typing import Any, Protocol

from myelin.atomic import write_atomic
from myelin.profile.spans import Span

__all__ = ["RANK_FORMAT", "SPAN_FIELDS", "RankProfiles", "collect", "spans_of", "write_json"]

RANK_FORMAT = "myelin-profile-rank"
SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(Span))


def collect(
    timeline: Any,
    counters: dict[str, list[list[float]]] | None = None,
    *,
    device: Any = None,
    replica: int | None = None,
) -> dict[str, Any]:
    """One rank's timeline (and sampled counters) as JSON-ready data, for a report; the
    timeline's own counters and detail (a strategy's figures) come along."""
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
        "mono_origin": timeline.origin,  # perf_counter: one clock for every rank on a host
        "host": socket.gethostname(),
        "span_fields": list(SPAN_FIELDS),
        "spans": [[getattr(s, f) for f in SPAN_FIELDS] for s in spans],
        "folded": getattr(timeline, "folded", None),  # older spans' totals (window.py)
        "counters": {**(counters or {}), **getattr(timeline, "counters", {})},
        "detail": {
            **getattr(timeline, "detail", {}),
            **{k: f() for k, f in getattr(timeline, "detail_sources", {}).items()},
        },
    }


def spans_of(record: dict[str, Any]) -> list[Span]:
    """The spans of a rank record (fields it names that Span lacks are dropped)."""
    fields = record.get("span_fields", SPAN_FIELDS)
    keep = [i for i, f in enumerate(fields) if f in SPAN_FIELDS]
    return [Span(**{fields[i]: row[i] for i in keep}) for row in record["spans"]]


def write_json(path: Path, data: Any, indent: int | None = None) -> Path:
    """Write `data` as JSON to `path`, whole, however many ranks write it at once."""
    text = json.dumps(data, indent=indent, separators=None if indent else (",", ":"))
    return write_atomic(path, text)


class RankProfiles(Protocol):
    """What the trace and the picture read of a profile (`ProfileReport` is one)."""

    ranks: list[dict[str, Any]]

    @property
    def source(self) -> str: ...

    @property
    def steady_steps(self) -> list[int]: ...

    def spans(self, rank: int) -> list[Span]: ...

    def summary(self) -> dict[str, Any]: ...
