"""What one rank's timeline is made of: `Span`, one timed thing, and the kinds and idle
causes a span can have. Shared by the timeline that records spans, the window that folds
old ones into totals, and the accounting that reads them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["IDLE_CAUSES", "KINDS", "Span"]

# What a span can be; "compute" kinds make a device busy, "wait" kinds are idle time.
KINDS = {
    "forward": "compute",
    "backward": "compute",
    "optimizer": "compute",
    "eval": "compute",
    "send": "comm",
    "recv": "comm",
    "wait": "wait",
    "allreduce": "wait",
    "offload": "wait",  # copies to and from host memory the device waits for
}
# bubble: a wait for a message that the schedule implies; latency, slow_peer and sync:
# the rest of such waits (profile/attribution.py tells them apart after the run)
IDLE_CAUSES = (
    "bubble",
    "latency",
    "slow_peer",
    "sync",
    "offload_wait",
    "collective_wait",
    "optimizer_host",
    "host_overhead",
)


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
