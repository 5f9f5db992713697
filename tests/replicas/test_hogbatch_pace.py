"""Emulated costs on a schedule (hogbatch_worker.due_time): late wake-ups are made up.

    python -m pytest -q tests/replicas/test_hogbatch_pace.py     # ~2 s

A worker that pads each update to its declared cost from the update's own start adds every
late wake-up to its cycle: with 18 processes on 2 cores that cost the emulated bench 15-20%
of its declared speeds. Kept on a schedule, the next update makes it up.
"""

from __future__ import annotations

import time

import pytest
import torch

from myelin.replicas import hogbatch_worker
from myelin.replicas.hogbatch_model import portable
from myelin.replicas.hogbatch_store import SharedModel
from myelin.replicas.hogbatch_worker import _Worker, due_time
from tests.replicas._problem import problem


def test_due_time_keeps_a_schedule_and_makes_up_at_most_one_cost():
    assert due_time(None, 5.0, 1.0) == 6.0  # no schedule yet: from the start
    assert due_time(6.0, 6.3, 1.0) == 7.0  # started 0.3 late: still due one cost after
    assert due_time(7.0, 6.9, 2.0) == 9.0  # a bigger update: its own cost
    assert due_time(6.0, 10.0, 1.0) == 10.0  # 4 late: only one cost made up


class _LateClock:
    """time for the worker: real time plus every sleep, each ending `late` s late."""

    def __init__(self, late: float) -> None:
        self.late, self.extra = late, 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.extra

    def monotonic(self) -> float:
        return time.monotonic() + self.extra

    def sleep(self, seconds: float) -> None:
        self.extra += seconds + self.late


@pytest.mark.parametrize("cost", [0.010, 0.050])
def test_late_wake_ups_do_not_slow_an_emulated_worker(monkeypatch, cost):
    model, (x, y), _ = problem()
    params = [p for p in model.parameters()]
    store = SharedModel.create(params, 2)
    job = {"model": portable(model), "loss_fn": torch.nn.MSELoss(), "lr": 0.01, "weight_decay": 0.0,
           "device": "cpu", "threads": 1, "seed": 0, "data_seed": 0, "timeout_s": 10,
           "record": None, "max_staleness": None, "cpu_lr_scale": 1.0,
           "emulate": ((cost, 0.0), (cost, 0.0))}  # fmt: skip
    worker = _Worker(1, job, store.handles(), (x, y))
    clock = _LateClock(late=0.8 * cost)  # every wait ends 80% of a cost late
    monkeypatch.setattr(hogbatch_worker, "time", clock)
    n = 20
    t0 = clock.perf_counter()
    for i in range(n):
        worker.train(0, 4 * i, 4)
    took = clock.perf_counter() - t0
    # padded from each update's own start: n x 1.8 costs; on a schedule: n costs + one late
    assert took < (n + 2) * cost, took / cost
    assert took >= n * cost
    assert int(store.counters[1]) == n
