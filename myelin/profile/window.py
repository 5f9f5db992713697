"""A bounded profile: the spans of the last `window_steps` steps, and the older ones folded
into running totals, so a long run's timeline stays flat while its figures stay exact.

Accounting (`accounting.seconds`) adds up over consecutive windows of time, so folding cuts
the time axis once per evicted step: [until, T) is accounted with every span that can
touch it (the evicted step's and the kept ones), where T is the end of the last evicted
span, and added to the totals of the whole run and, from the first record of the first
steady-state step on (after `warmup_steps`), of the steady state. A report adds the kept
spans' figures from `until` on. Spans of evicted steps are gone from the trace and the
picture, which show the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from myelin.profile.accounting import add_seconds, seconds
from myelin.profile.spans import Span

__all__ = ["Window"]


class Window:
    """The folded part of one rank's profile (see the module docstring)."""

    def __init__(self, window_steps: int, warmup_steps: int, host_device: bool) -> None:
        self.window_steps = window_steps
        self.warmup_steps = warmup_steps
        self.host_device = host_device
        self.first_steps: list[int] = []  # the warmup_steps + 1 smallest steps seen
        self.first_start: float | None = None  # the first record's start
        self.until: float | None = None  # folded up to here
        self.steady_start: float | None = None  # the first steady-state record's start
        self.whole: dict[str, Any] | None = None  # seconds, whole run, up to `until`
        self.steady: dict[str, Any] | None = None  # seconds, steady state, up to `until`

    def saw(self, step: int) -> None:
        """Note a step number (to know which step the steady state begins with)."""
        if step not in self.first_steps:
            self.first_steps = sorted([*self.first_steps, step])[: self.warmup_steps + 1]

    def should_fold(self, steps_kept: int) -> bool:
        """Whether the oldest kept step goes now: more steps than the window, and the
        steady state's first step already seen (so its start is known when folding)."""
        return steps_kept > self.window_steps + 1 and len(self.first_steps) > self.warmup_steps

    def fold(self, evicted: Sequence[Span], nearby: Sequence[Span]) -> None:
        """Add the time up to the end of `evicted` (spans of the oldest step) to the totals;
        `nearby`: the kept spans that began before that end."""
        if not evicted:
            return
        spans = [*evicted, *nearby]
        if self.until is None:
            self.first_start = self.until = min(s.start for s in spans)
        end = max(self.until, max(s.end for s in evicted))
        steady_step = self.first_steps[self.warmup_steps]
        starts = [s.start for s in spans if s.step >= steady_step]
        if starts:
            first = min(starts)
            self.steady_start = (
                first if self.steady_start is None else min(self.steady_start, first)
            )
        part = seconds(spans, self.until, end, self.host_device)
        self.whole = part if self.whole is None else add_seconds(self.whole, part)
        if self.steady_start is not None and self.steady_start < end:
            if self.steady_start > self.until:  # the steady state begins inside this part
                part = seconds(spans, self.steady_start, end, self.host_device)
            self.steady = part if self.steady is None else add_seconds(self.steady, part)
        self.until = end

    def record(self) -> dict[str, Any] | None:
        """The folded totals as JSON-ready data for a rank's record (None: nothing folded)."""
        if self.until is None:
            return None
        return {
            "window_steps": self.window_steps,
            "warmup_steps": self.warmup_steps,
            "first_steps": list(self.first_steps),
            "first_start": self.first_start,
            "until": self.until,
            "steady_start": self.steady_start,
            "whole": self.whole,
            "steady": self.steady,
        }
