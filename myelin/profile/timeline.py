"""Per-rank records of what the event loop did and when.

Every operation, wait, send and collective is one `Span`: a kind, a name in the
pipelining notation (`1F3`, `1SEND_F3`), the track it ran on, the step and
microbatch, and its start and end in seconds on this rank's monotonic clock.
Waits carry the cause of the idleness, so a report can say why a device sat idle.
On a GPU, operations are timed with CUDA events read back off the hot path (when the
spans are read), so recording never synchronizes the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["Span", "Timeline", "KINDS", "IDLE_CAUSES"]

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


class Timeline:
    """An append-only list of spans with one clock origin; cheap enough to leave on.

    device: on a CUDA device `op` times operations with CUDA events on the current
    stream, read back off the hot path; elsewhere `op` reads the monotonic clock.
    """

    def __init__(self, rank: int, stage: int, enabled: bool = True, device: Any = None) -> None:
        self.rank = rank
        self.stage = stage
        self.enabled = enabled
        self._ref = None  # a CUDA event recorded at the origin
        self._device = torch.device(device) if device is not None else None
        self._pending: list[tuple[Any, Any, str, str, int, dict[str, Any]]] = []
        if device is not None and torch.device(device).type == "cuda":
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(torch.cuda.current_stream(device))
            self._ref.synchronize()  # once, here: the event and the clocks below agree
        self.origin = time.perf_counter()
        self.wall_origin = time.time()  # to line ranks up in one trace
        self._spans: list[Span] = []
        self._busy_s = 0.0

    @property
    def spans(self) -> list[Span]:
        """Every span so far; reading them waits for the device's pending timings."""
        self._resolve(wait=True)
        return self._spans

    @property
    def busy_s(self) -> float:
        """Compute seconds so far (timed even when recording is off), as far as known now."""
        self._resolve(wait=False)
        return self._busy_s

    def now(self) -> float:
        """Seconds since this timeline's origin."""
        return time.perf_counter() - self.origin

    def add(self, kind: str, name: str, start: float, end: float, step: int, **fields: Any) -> None:
        """Record a span (only counted when disabled); `track` defaults to the kind's group."""
        if KINDS[kind] == "compute":
            self._busy_s += end - start
        if not self.enabled:
            return
        track = fields.pop("track", None) or KINDS[kind]
        self._spans.append(Span(kind, name, track, step, start, end, **fields))

    def range(self, name: str) -> Any:
        """A torch.profiler range named `name` while torch's profiler records (a wait, say)."""
        return _torch_range(name)

    @contextlib.contextmanager
    def op(self, kind: str, name: str, step: int, **fields: Any) -> Iterator[None]:
        """Time the operation run inside: on the device (CUDA events) or by the clock.

        While torch.profiler records, the operation is also a range named `name` there,
        so `myelin profile` finds myelin's operations in a torch.profiler trace.
        """
        with _torch_range(name):
            if self._ref is None:
                start = self.now()
                yield
                self.add(kind, name, start, self.now(), step, **fields)
            else:
                stream = torch.cuda.current_stream(self._device)  # this rank's GPU, not cuda:0
                begin = torch.cuda.Event(enable_timing=True)
                begin.record(stream)
                yield
                end = torch.cuda.Event(enable_timing=True)
                end.record(torch.cuda.current_stream(self._device))
                self._pending.append((begin, end, kind, name, step, fields))
                if len(self._pending) > 64:
                    self._resolve(wait=False)  # keep the list short; never waits

    def _resolve(self, wait: bool) -> None:
        """Turn finished CUDA events into spans, in order; `wait` for unfinished ones."""
        while self._pending:
            begin, end, kind, name, step, fields = self._pending[0]
            if not wait and not end.query():
                return
            end.synchronize()
            self._pending.pop(0)
            start_s = self._ref.elapsed_time(begin) / 1e3
            self.add(kind, name, start_s, self._ref.elapsed_time(end) / 1e3, step, **fields)

    def clear(self) -> None:
        self._resolve(wait=True)
        self._spans.clear()


def _torch_range(name: str) -> Any:
    """A torch.profiler range while torch's profiler records, else nothing (cheap)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
