"""Per-rank records of what the event loop did and when.

Every operation, wait, send and collective is one `Span`: a kind, a name in the
pipelining notation (`1F3`, `1SEND_F3`), the track it ran on, the step and
microbatch, and its start and end in seconds on this rank's monotonic clock.
Waits carry the cause of the idleness, so a report can say why a device sat idle.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Span", "Timeline", "KINDS", "IDLE_CAUSES"]

# What a span can be; "compute" kinds make a device busy, "wait" kinds are idle time.
KINDS = {
    "forward": "compute",
    "backward": "compute",
    "optimizer": "compute",
    "eval": "compute",
    "send": "comm",
    "wait": "wait",
    "allreduce": "wait",
}
IDLE_CAUSES = ("bubble", "offload_wait", "collective_wait", "optimizer_host", "host_overhead")


@dataclass(slots=True)
class Span:
    """One timed thing one rank did."""

    kind: str  # a key of KINDS
    name: str  # "1F3", "1B3", "1SEND_F3", "1WAIT", "1ALLREDUCE", "1OPT"
    track: str  # "compute", "comm", or "peer N" for messages to and from rank N
    step: int
    start: float  # seconds since the timeline's origin
    end: float
    microbatch: int | None = None
    cause: str | None = None  # for waits: one of IDLE_CAUSES
    peer: int | None = None  # the other rank of a send or of the message a wait ended with
    nbytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Timeline:
    """An append-only list of spans with one clock origin; cheap enough to leave on."""

    def __init__(self, rank: int, stage: int, enabled: bool = True) -> None:
        self.rank = rank
        self.stage = stage
        self.enabled = enabled
        self.origin = time.perf_counter()
        self.wall_origin = time.time()  # to line ranks up in one trace
        self.spans: list[Span] = []
        self.busy_s = 0.0  # compute seconds so far, counted even when recording is off

    def now(self) -> float:
        """Seconds since this timeline's origin."""
        return time.perf_counter() - self.origin

    def add(self, kind: str, name: str, start: float, end: float, step: int, **fields: Any) -> None:
        """Record a span (only counted when disabled); `track` defaults to the kind's group."""
        if KINDS[kind] == "compute":
            self.busy_s += end - start
        if not self.enabled:
            return
        track = fields.pop("track", None) or KINDS[kind]
        self.spans.append(Span(kind, name, track, step, start, end, **fields))

    def clear(self) -> None:
        self.spans.clear()
