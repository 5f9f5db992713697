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
from collections.abc import Callable, Iterator
from typing import Any

import torch

from myelin.profile.accounting import seconds
from myelin.profile.config import ProfileConfig
from myelin.profile.spans import IDLE_CAUSES, KINDS, Span
from myelin.profile.window import Window

__all__ = ["Span", "Timeline", "KINDS", "IDLE_CAUSES"]


class Timeline:
    """The spans of one rank with one clock origin; cheap enough to leave on.

    device: on a CUDA device `op` times operations with CUDA events on the current
    stream, read back off the hot path; elsewhere `op` reads the monotonic clock.
    window_steps: keep the spans of the last this many steps (and the current one) and
    fold older ones into running totals (profile/window.py); None keeps every span.
    warmup_steps: the steps the totals leave out of the steady state, as the report does.
    """

    def __init__(
        self,
        rank: int,
        stage: int,
        enabled: bool = True,
        device: Any = None,
        *,
        window_steps: int | None = None,
        warmup_steps: int = 1,
    ) -> None:
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
        self.on_host = device is None or torch.device(device).type != "cuda"
        self._window_args = (window_steps, warmup_steps, self.on_host)
        self._window = Window(*self._window_args) if window_steps is not None else None
        self._by_step: dict[int, list[Span]] = {}  # with a window: the kept spans, by step
        self._starts: dict[int, float] = {}  # each kept step's earliest start
        # what a part of the run that is not spans reports (Hogbatch's workers): counter
        # tracks {name: [[seconds since origin, value], ...]} and figures for summary.json
        self.counters: dict[str, list[list[float]]] = {}
        self.detail: dict[str, Any] = {}
        # figures for `detail` read when the record is collected (the replica strategy's
        # communication by kind: trainer.py)
        self.detail_sources: dict[str, Callable[[], Any]] = {}

    @classmethod
    def of_profile(
        cls, config: ProfileConfig | None, rank: int, stage: int, device: Any
    ) -> Timeline:
        """The timeline a trainer keeps: recording with `config`'s window, or (None) only
        counting busy time."""
        if config is None:
            return cls(rank, stage, False, device)
        return cls(
            rank,
            stage,
            True,
            device,
            window_steps=config.window_steps,
            warmup_steps=config.warmup_steps,
        )

    @property
    def spans(self) -> list[Span]:
        """Every span kept (with a window: of its steps, in the order they ended); reading
        them waits for the device's pending timings."""
        self._resolve(wait=True)
        if self._window is not None:
            return sorted((s for kept in self._by_step.values() for s in kept), key=_end)
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
        span = Span(kind, name, track, step, start, end, **fields)
        if self._window is None:
            self._spans.append(span)
        else:
            self._keep(span)

    def _keep(self, span: Span) -> None:
        """Keep `span` in the window, and fold the oldest steps out while there are too many."""
        window, step = self._window, span.step
        window.saw(step)
        self._by_step.setdefault(step, []).append(span)
        self._starts[step] = min(self._starts.get(step, span.start), span.start)
        while window.should_fold(len(self._by_step)):
            oldest = min(self._by_step)
            evicted = self._by_step.pop(oldest)
            del self._starts[oldest]
            end = max(s.end for s in evicted)
            nearby = [  # kept spans that began before the evicted step's last one ended
                s
                for k, kept in self._by_step.items()
                if self._starts[k] < end
                for s in kept
                if s.start < end
            ]
            window.fold(evicted, nearby)

    def compute_s(self, until: float) -> float:
        """Compute seconds from the first record to `until` (not before the last fold), as
        the report counts them (on a host device, sends and receives inside operations
        are not compute); fit's meter takes differences of it."""
        self._resolve(wait=True)
        folded = self._window.whole if self._window is not None else None
        start = self._window.until if folded is not None else None
        spans = self.spans if start is None else [s for s in self.spans if s.end > start]
        if start is None:
            start = min((s.start for s in spans), default=until)
        busy = seconds(spans, start, max(start, until), self.on_host)["busy"]
        return busy + (folded["busy"] if folded is not None else 0.0)

    @property
    def folded(self) -> dict[str, Any] | None:
        """The totals of the spans folded out of the window, for a record (None: none)."""
        self._resolve(wait=True)
        return self._window.record() if self._window is not None else None

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
        """Forget every span and the folded totals."""
        self._resolve(wait=True)
        self._spans = []
        self._by_step.clear()
        self._starts.clear()
        if self._window is not None:
            self._window = Window(*self._window_args)


def _end(span: Span) -> float:
    return span.end


def _torch_range(name: str) -> Any:
    """A torch.profiler range while torch's profiler records, else nothing (cheap)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
