"""A Hogbatch worker lost at the worst moments (myelin/replicas/hogbatch_run.py, _store.py).

A worker that dies after adding its update but before saying `done` must not have its range
trained again (the samples would count twice in the weights); one that dies holding the
shared model's lock must not leave the others waiting for it for ever.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque

import pytest
import torch

import myelin
from myelin.errors import DeadlineError
from myelin.replicas.hogbatch_dispatch import Dispatcher
from myelin.replicas.hogbatch_rule import Controller
from myelin.replicas.hogbatch_run import _Run
from myelin.replicas.hogbatch_store import SharedModel


class _Gone:
    """A worker process that has exited."""

    exitcode = -9

    def is_alive(self) -> bool:
        return False


class _Evaluations:
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def submit(self, epoch, wall_s, weights, seen=0.0) -> None:
        self.epochs.append(epoch)


def _run_with_one_cpu_worker(policy: str = "reassign") -> _Run:
    cfg = myelin.Hogbatch(cpu_workers=1, cpu_batch=4, lock=True, timeout_s=5,
                          on_worker_loss=policy)  # fmt: skip
    ctl = Controller(lo=8, hi=8, ratio=1.0, budget=0.0, adaptive=False)
    store = SharedModel.create([torch.zeros(3)], 2, multiprocessing.get_context("spawn").Lock(),
                               timeout_s=5)  # fmt: skip
    run = _Run(cfg, ctl, store, Dispatcher(12, 1))
    run.procs = [_Gone(), _Gone()]
    run.alive = {1}
    return run


def test_a_range_whose_update_landed_before_its_worker_died_is_done_not_retrained():
    run = _run_with_one_cpu_worker()
    ranges = [run.disp.take(1, 4) for _ in range(3)]  # the whole epoch: 12 samples
    run.busy[1] = deque(ranges)
    run.store.counters[1] = 2  # it added the first two updates, then died before `done`
    evaluations = _Evaluations()
    run._lost(1, evaluations)
    assert run.stats[1]["updates"] == 2 and run.stats[1]["samples"] == 8
    assert list(run.disp.pending) == [ranges[2]]  # only the third is trained again
    assert run.disp.left == {0: 4} and evaluations.epochs == []
    # the one given back completes the epoch once trained by another worker
    again = run.disp.take(0, 8)
    assert again == ranges[2] and run.disp.done(0, again) and run.disp.completed == [0]


def test_an_epoch_completed_by_the_landed_updates_of_a_dead_worker_is_evaluated():
    run = _run_with_one_cpu_worker()
    ranges = [run.disp.take(1, 4) for _ in range(3)]
    run.disp.done(1, ranges[0])
    run.disp.done(1, ranges[1])
    run.stats[1]["updates"] = 2
    run.busy[1] = deque([ranges[2]])
    run.store.counters[1] = 3
    evaluations = _Evaluations()
    run._lost(1, evaluations)
    assert run.disp.completed == [0] and evaluations.epochs == [0]
    assert not run.disp.pending


def _hold_the_lock_and_die(handles) -> None:
    store = SharedModel(*handles, me=1)
    held = store._held()  # kept: a collected generator would run its `finally` and release
    held.__enter__()  # acquire, and never leave
    os._exit(0)


def test_a_lock_held_by_a_dead_worker_is_named_and_freed():
    ctx = multiprocessing.get_context("spawn")
    store = SharedModel.create([torch.ones(4)], 2, ctx.Lock(), timeout_s=0.2)
    child = ctx.Process(target=_hold_the_lock_and_die, args=(store.handles(),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    with pytest.raises(DeadlineError, match=r"lock was not free within 0.2s \(held by worker 1\)"):
        store.snapshot()
    assert not store.release_from(2)  # not the holder: nothing freed
    assert store.release_from(1)
    assert torch.equal(store.snapshot(), torch.ones(4))
    assert int(store.owner[0]) == -1


def test_the_runner_frees_the_lock_of_a_worker_found_dead_while_it_waits_for_it():
    run = _run_with_one_cpu_worker()
    assert run.store.lock.acquire(timeout=1)
    run.store.owner[0] = 1  # worker 1 took it, then died (its process is gone)
    assert torch.equal(run.snapshot(), torch.zeros(3))
    assert int(run.store.owner[0]) == -1 and run.store.lock.acquire(timeout=1)
