"""Hogbatch on a simulated clock: the dispatcher and the adaptive rule with declared speeds.

One process, no sleeping, deterministic: each worker's batch of b samples takes o + b / s
simulated seconds. Worker 0 is the device, the others CPU workers. The same `Dispatcher`
and `Controller` as the real runner decide who trains on what and at which batch, so this
checks the schedule (every sample once per epoch, update shares, staleness) without the
noise of real processes; `lose` drops a worker at a simulated time, as a crash would.
"""

from __future__ import annotations

import heapq
import statistics
from typing import Any

import torch

from myelin.replicas.hogbatch_dispatch import Dispatcher
from myelin.replicas.hogbatch_rule import Controller

__all__ = ["simulate"]


def simulate(
    *,
    samples: int,
    epochs: int,
    device: tuple[float, float],
    cpus: list[tuple[float, float]],
    cpu_batch: int,
    controller: Controller,
    seed: int = 0,
    lose: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Run the schedule; update counts, per-epoch coverage counts, staleness, batch trace."""
    speeds = [device, *cpus]
    disp = Dispatcher(samples, epochs, seed)
    coverage: dict[int, torch.Tensor] = {}
    updates = [0] * len(speeds)
    tau: dict[int, list[int]] = {w: [] for w in range(len(speeds))}
    lose = dict(lose or {})
    order: list[int] = []  # the worker of each update, in order
    version, now, seq = 0, 0.0, 0
    heap: list[tuple[float, int, int, Any, int, int]] = []

    def start(w: int) -> None:
        nonlocal seq
        batch = controller.batch if w == 0 else cpu_batch
        r = disp.take(w, batch)
        if r is None:
            return
        o, s = speeds[w]
        seq += 1
        heapq.heappush(heap, (now + o + r.count / s, seq, w, r, version, r.count))

    idle: set[int] = set()
    for w in range(len(speeds)):
        start(w)
    while heap:
        end, _, w, r, v_read, count = heapq.heappop(heap)
        now = end
        gone = [k for k, t in lose.items() if t <= now]
        for k in gone:
            del lose[k]
            disp.lose(k)
            controller.forget(k)
            heap = [e for e in heap if e[2] != k]
            heapq.heapify(heap)
            idle.discard(k)
            speeds[k] = (float("inf"), 1.0)
        if w in gone:
            continue
        perm = disp.permutation(r.epoch)[r.start : r.start + r.count]
        coverage.setdefault(r.epoch, torch.zeros(samples, dtype=torch.int64))[perm] += 1
        tau[w].append(version - v_read)
        version += 1
        updates[w] += 1
        order.append(w)
        disp.done(w, r)
        controller.observe(w, count, speeds[w][0] + count / speeds[w][1], device=w == 0)
        for k in [w, *sorted(idle)]:
            idle.discard(k)
            if speeds[k][0] != float("inf"):
                before = len(heap)
                start(k)
                if len(heap) == before:
                    idle.add(k)
    total = sum(updates)
    return {
        "time_s": now,
        "updates": updates,
        "order": order,
        "share": [u / total for u in updates],
        "coverage": coverage,
        "tau_median": [float(statistics.median(t)) if t else 0.0 for t in tau.values()],
        "trace": list(controller.trace),
        "all_done": disp.all_done(),
    }
