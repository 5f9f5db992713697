"""Idle accounting: one rank's wall time cut into busy time and idle time by cause.

In a window [start, end] the parts are disjoint and add up to 100%: busy (forward,
backward, optimizer, evaluation, GPU kernels), then each idle cause in the order of
`CAUSES` claims the time its waits cover that nothing before it claimed: bubble (no
operation ready, waiting for a message the schedule implies), the other waits for a
message (latency, a slow peer, step-end sync: attribution.py), offload wait,
collective wait (all-reduce), optimizer on the host; for torch.profiler traces also
HTA's host wait, short gap and other. What no record covers is host overhead. An offload
wait inside an operation's record (backward waiting for the pages of its next layer) is
that wait, not busy time. Times are intervals: sorted, disjoint lists of (start, end).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from myelin.profile.attribution import MESSAGE_CAUSES
from myelin.profile.spans import IDLE_CAUSES, KINDS, Span

__all__ = [
    "BUSY_KINDS",
    "CAUSES",
    "COMM_KINDS",
    "HTA_CAUSES",
    "account",
    "add_seconds",
    "fractions",
    "merge_intervals",
    "seconds",
]

HTA_CAUSES = ("host_wait", "short_gap", "other")
# Idle causes in the order they claim time; host overhead is what none claims.
CAUSES = (
    "bubble",
    *MESSAGE_CAUSES[1:],  # waits for a message the schedule does not imply (attribution.py)
    "offload_wait",
    "collective_wait",
    "optimizer_host",
    *HTA_CAUSES,
)
BUSY_KINDS = frozenset(
    {k for k, g in KINDS.items() if g == "compute"} | {"kernel", "memcpy", "memset", "cpu_op"}
)
COMM_KINDS = frozenset({"send", "recv", "collective"})

Interval = tuple[float, float]


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
    return fractions(seconds(spans, start, end, host_device, hta))


def seconds(
    spans: Sequence[Span],
    start: float,
    end: float,
    host_device: bool = False,
    hta: bool = False,
) -> dict[str, Any]:
    """`account`'s figures as seconds, which add up over consecutive windows (so a profile
    can fold old spans into running totals, profile/window.py)."""

    def clipped(keep: Any) -> list[Interval]:
        return merge_intervals((max(s.start, start), min(s.end, end)) for s in spans if keep(s))

    wall = max(end - start, 0.0)
    busy = clipped(lambda s: s.cause is None and s.kind in BUSY_KINDS)
    loop_comm = clipped(lambda s: s.kind in ("send", "recv"))
    if host_device:
        busy = _subtract(busy, loop_comm)
    busy = _subtract(busy, clipped(lambda s: s.cause == "offload_wait"))
    covered, idle = busy, {}
    extra = sorted({s.cause for s in spans if s.cause and s.cause not in CAUSES})
    for cause in (*CAUSES, *extra):
        own = _subtract(clipped(lambda s, c=cause: s.cause == c), covered)
        if own or hta or cause not in HTA_CAUSES:
            idle[cause] = _total(own)
            covered = merge_intervals(covered + own)
    idle["host_overhead"] = max(wall - _total(covered), 0.0)
    comm = clipped(lambda s: s.kind in COMM_KINDS)
    ordered = {c: idle.pop(c) for c in IDLE_CAUSES}
    ordered.update(idle)
    return {
        "wall": wall,
        "busy": _total(busy),
        "idle": ordered,
        "comm": _total(comm),
        "overlap": _intersect_total(comm, busy),
        # of host overhead: the loop handing messages over, not hidden behind compute
        "exposed_send": _total(_subtract(loop_comm, covered)),
    }


def add_seconds(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The seconds of two consecutive windows, as those of one."""
    idle = dict(a["idle"])
    for cause, value in b["idle"].items():
        idle[cause] = idle.get(cause, 0.0) + value
    out = {k: a[k] + b[k] for k in ("wall", "busy", "comm", "overlap", "exposed_send")}
    return {**out, "idle": idle}


def fractions(sec: dict[str, Any]) -> dict[str, Any]:
    """`seconds` as `account` reports them: fractions of the wall time."""
    wall, comm = sec["wall"], sec["comm"]
    return {
        "wall_s": wall,
        "busy_frac": _frac(sec["busy"], wall),
        "idle": {c: _frac(v, wall) for c, v in sec["idle"].items()},
        "overlap_frac": sec["overlap"] / comm if comm else None,
        "comm_s": comm,
        "exposed_send_frac": _frac(sec["exposed_send"], wall),
    }


def _frac(x: float, wall: float) -> float:
    return x / wall if wall > 0 else 0.0
