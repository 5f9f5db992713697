"""Adaptive Hogbatch's batch-size rule, as pure functions (OURS: the paper publishes none).

Ma and Rusu's Adaptive Hogbatch changes the device batch "with the relative speed" of the
workers, "at the expense of a customizable decrease in utilization"; no formula is public
(shared/algorithms/hogbatch.md, 2.2). This is myelin's rule:

1. Each worker's time per update is modelled as  t(b) = o + b / s  (o: per-update overhead
   with the model pull and push; s: samples per second at full efficiency), fitted by
   least squares over a sliding window of (batch, seconds) pairs (`fit_update_time`).
2. The device's efficiency at batch b is  eta(b) = b / (b + o_d * s_d)  (`efficiency`);
   the utilization budget eps asks eta >= 1 - eps, so b >= o_d * s_d * (1 - eps) / eps
   (`budget_floor`). eps -> 0 gives the largest batch: fixed CPU+GPU Hogbatch. The o_d
   used there is at least MIN_OVERHEAD of an update at the largest batch
   (`budget_overhead`): a fit that finds no overhead (noise, or time growing faster than
   the batch: the intercept is clipped to 0) would put the floor at 0 for any budget.
3. The target ratio rho = device updates / CPU updates is met when 1 / t_d(b) = rho * U_c
   (U_c: the CPU workers' updates per second together): b = s_d * (1 / (rho * U_c) - o_d)
   (`ratio_batch`).
4. The device batch is max(ratio batch, budget floor), clamped to [lo, hi], and moves at
   most 2x (or 1/2x) from the current one per adjustment (`choose_device_batch`).

`Controller` keeps the fit windows and applies the rule after every device batch; its
state goes into checkpoints.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MIN_OVERHEAD",
    "Controller",
    "budget_floor",
    "budget_overhead",
    "choose_device_batch",
    "efficiency",
    "fit_update_time",
    "ratio_batch",
]


def fit_update_time(batches: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares (overhead o in s, throughput s in samples/s) of t = o + b / s.

    With one distinct batch size (a CPU worker) the line is not identifiable: all the time
    is put on throughput (o = 0), which still predicts t at that batch exactly."""
    if len(batches) != len(seconds) or not batches:
        raise ValueError(f"need equal, non-empty samples (got {len(batches)}, {len(seconds)})")
    n = len(batches)
    mb, mt = sum(batches) / n, sum(seconds) / n
    var = sum((b - mb) ** 2 for b in batches)
    if var <= 1e-12 * max(mb * mb, 1.0):
        return 0.0, mb / max(mt, 1e-12)
    slope = sum((b - mb) * (t - mt) for b, t in zip(batches, seconds)) / var
    overhead = max(mt - slope * mb, 0.0)
    if slope <= 0:  # time does not grow with the batch: all overhead, throughput unbounded
        return mt, math.inf
    return overhead, 1.0 / slope


def efficiency(batch: float, overhead: float, throughput: float) -> float:
    """The device's share of time spent on samples at this batch: b / (b + o * s)."""
    if math.isinf(throughput):
        return 0.0 if overhead > 0 else 1.0
    return batch / (batch + overhead * throughput)


# Every update pulls and pushes the whole model, so no device update is free of overhead:
# the budget floor takes at least this share of an update at the largest batch as one.
# Fits of real overheads are larger (the bench's device: 2.4% at 4096); with it, a budget
# eps keeps the batch >= about hi * (1 - eps) / (100 * eps): 0.01 -> 0.99 hi, 0.3 -> 0.02 hi.
MIN_OVERHEAD = 0.01


def budget_overhead(overhead: float, throughput: float, hi: float) -> float:
    """The overhead the budget floor assumes: the fitted one, but at least MIN_OVERHEAD of the
    fitted time of an update at `hi`, so a budget near 0 keeps the batch near `hi`."""
    if math.isinf(throughput):
        return overhead  # time does not grow with the batch: it is all overhead already
    return max(overhead, MIN_OVERHEAD * (max(overhead, 0.0) + hi / throughput))


def budget_floor(overhead: float, throughput: float, budget: float) -> float:
    """The smallest batch whose efficiency is at least 1 - budget (inf when budget is 0)."""
    if budget <= 0:
        return math.inf
    if budget >= 1 or overhead <= 0:
        return 0.0  # no overhead: every batch is efficient (also when throughput is inf)
    return overhead * throughput * (1.0 - budget) / budget


def ratio_batch(overhead: float, throughput: float, cpu_rate: float, ratio: float) -> float:
    """The device batch at which device updates / CPU updates = ratio (<= 0: not reachable,
    the device is too slow even at batch 0; inf: no CPU updates to balance)."""
    if cpu_rate <= 0:
        return math.inf
    gap = 1.0 / (ratio * cpu_rate) - overhead  # seconds per device update left for samples
    if math.isinf(throughput):  # time does not grow with the batch: any batch or none
        return math.inf if gap > 0 else 0.0 if gap == 0 else -math.inf
    return throughput * gap


def choose_device_batch(
    current: int,
    overhead: float,
    throughput: float,
    cpu_rate: float,
    *,
    ratio: float,
    budget: float,
    lo: int,
    hi: int,
) -> int:
    """The next device batch: max(ratio batch, budget floor) in [lo, hi], within 2x of current.
    The floor's overhead is `budget_overhead`'s, never under MIN_OVERHEAD of an update at hi."""
    want = max(
        ratio_batch(overhead, throughput, cpu_rate, ratio),
        budget_floor(budget_overhead(overhead, throughput, hi), throughput, budget),
    )
    want = min(max(want, lo), hi)
    want = min(max(want, current / 2), current * 2)
    # up, not to the nearest: a rounded-down floor is under the budget, half of 5 is not 2
    return int(min(max(math.ceil(want * (1 - 1e-12)), lo), hi))


class Controller:
    """The adaptive rule run over measured batches: fit windows per worker, one device batch.

    `observe` after each finished batch; `device_batch` is the batch to hand out next. The
    first two device batches probe hi and hi/2 (so the line is identifiable); budget 0 or
    adaptive off keep hi throughout (fixed CPU+GPU Hogbatch). While the device's window
    holds one batch size only (the probe not back yet, or a batch that held for a whole
    window) its line is not identifiable: the last fit that was holds, and before any
    the batch stays (an unidentified fit puts all the time on throughput, no overhead,
    whose budget floor is only MIN_OVERHEAD's)."""

    def __init__(
        self, *, lo: int, hi: int, ratio: float, budget: float, adaptive: bool, window: int = 16
    ) -> None:
        self.lo, self.hi, self.ratio, self.budget = lo, hi, ratio, budget
        self.adaptive = adaptive and budget > 0
        self.window = window
        self.batch = hi
        self.samples: dict[int, deque] = {}  # worker -> deque of (batch, seconds)
        self.device_seen = 0
        self.fit: tuple[float, float] | None = None  # the device's last identifiable (o, s)
        self.trace: list[int] = [hi]  # device batch after each adjustment

    def observe(self, worker: int, batch: int, seconds: float, device: bool) -> None:
        """Record one finished batch; after a device batch, re-choose the device batch."""
        win = self.samples.setdefault(worker, deque(maxlen=self.window))
        win.append((float(batch), float(seconds)))
        if not device or not self.adaptive:
            return
        self.device_seen += 1
        if self.device_seen == 1:
            self.batch = max(self.lo, self.hi // 2)  # the probe
        else:
            if len({b for b, _ in win}) > 1:
                self.fit = fit_update_time(*zip(*win))
            if self.fit is not None:
                o, s = self.fit
                self.batch = choose_device_batch(
                    self.batch, o, s, self.cpu_rate(worker), ratio=self.ratio,
                    budget=self.budget, lo=self.lo, hi=self.hi,
                )  # fmt: skip
        self.trace.append(self.batch)

    def forget(self, worker: int) -> None:
        """`worker` is gone: its updates no longer count in the CPU workers' rate."""
        self.samples.pop(worker, None)

    def cpu_rate(self, device_worker: int) -> float:
        """Updates per second of all other (CPU) workers together, from their windows."""
        rate = 0.0
        for w, win in self.samples.items():
            if w != device_worker and win:
                rate += len(win) / sum(t for _, t in win)
        return rate

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint: the windows, the device batch, the trace."""
        return {
            "batch": self.batch,
            "device_seen": self.device_seen,
            "fit": list(self.fit) if self.fit is not None else None,
            "samples": {w: list(win) for w, win in self.samples.items()},
            "trace": list(self.trace),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict`'s output."""
        self.batch = int(state["batch"])
        self.device_seen = int(state["device_seen"])
        fit = state.get("fit")  # absent from checkpoints written before it was kept
        self.fit = (float(fit[0]), float(fit[1])) if fit is not None else None
        self.samples = {
            int(w): deque([tuple(p) for p in win], maxlen=self.window)
            for w, win in state["samples"].items()
        }
        self.trace = list(state["trace"])
