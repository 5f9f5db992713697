"""Hogbatch's schedule on a simulated clock, and the dispatcher's exactly-once ranges.

python -m pytest -q tests/replicas/test_hogbatch_sim.py
"""

from __future__ import annotations

import pytest
import torch

from myelin.replicas.hogbatch_dispatch import Dispatcher, Range, progress_done
from myelin.replicas.hogbatch_rule import Controller
from myelin.replicas.hogbatch_sim import simulate

DEVICE = (0.02, 50_000.0)  # 20 ms per update, 50k samples/s
CPU = (0.002, 2_000.0)  # 2 ms per update, 2k samples/s: batch 4 in 4 ms


def run(adaptive, budget=0.5, ratio=1.0, cpus=2, lose=None, epochs=3, device=DEVICE, cpu=CPU):
    c = Controller(lo=16, hi=4096, ratio=ratio, budget=budget, adaptive=adaptive)
    return simulate(samples=20_000, epochs=epochs, device=device, cpus=[cpu] * cpus,
                    cpu_batch=4, controller=c, seed=1, lose=lose)  # fmt: skip


def assert_exactly_once(res, epochs=3):
    assert res["all_done"]
    assert sorted(res["coverage"]) == list(range(epochs))
    for counts in res["coverage"].values():
        assert torch.equal(counts, torch.ones_like(counts))


def test_fixed_hogbatch_covers_each_sample_once_and_cpu_makes_most_updates():
    res = run(adaptive=False)
    assert_exactly_once(res)
    assert res["trace"] == [4096]
    # analytic share: device 1/(0.02+4096/50000) = 9.8/s, CPUs 2 x 250/s
    dev_rate, cpu_rate = 1 / (0.02 + 4096 / 50_000), 2 / (0.002 + 4 / 2000)
    assert res["share"][0] == pytest.approx(dev_rate / (dev_rate + cpu_rate), rel=0.15)
    assert res["share"][0] < 0.05


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_adaptive_update_share_reaches_the_target(ratio):
    # CPU: batch 4 in 40 ms (25 updates/s); device: 20 ms + b / 5000 per update, so the
    # ratio is met at b = 100 (ratio 1) or 300 (ratio 0.5), above the budget's floor (11)
    res = run(adaptive=True, budget=0.9, ratio=ratio, cpus=1, epochs=2,
              device=(0.02, 5000.0), cpu=(0.02, 200.0))  # fmt: skip
    assert_exactly_once(res, epochs=2)
    late = res["order"][len(res["order"]) // 4 :]  # after the first halvings from 4096
    assert late.count(0) / late.count(1) == pytest.approx(ratio, rel=0.10)
    assert res["trace"][-1] == pytest.approx(100 if ratio == 1 else 300, rel=0.1)
    assert min(res["trace"]) >= 16 and max(res["trace"]) == 4096
    # the device's staleness follows from the ratio: about 1/ratio CPU updates per batch
    assert res["tau_median"][0] == pytest.approx(1 / ratio, abs=1)


def test_a_small_budget_holds_the_device_batch_at_its_floor():
    res = run(adaptive=True, budget=0.1, cpus=2, epochs=2)
    floor = 50_000 * 0.02 * 0.9 / 0.1  # 9000 > hi: the budget keeps the largest batch
    assert floor > 4096 and set(res["trace"][2:]) == {4096}


def test_a_lost_worker_gives_its_range_back_and_every_sample_is_still_seen_once():
    res = run(adaptive=True, lose={1: 0.5})
    assert_exactly_once(res)


def test_dispatcher_ranges_pending_first_and_no_second_epoch_ahead():
    d = Dispatcher(10, epochs=3, seed=0)
    a = d.take(0, 6)
    b = d.take(1, 6)
    assert (a, b) == (Range(0, 0, 6), Range(0, 6, 4))
    assert d.lose(0) == [a]
    assert d.take(1, 4) == Range(0, 0, 4)  # the lost range first, split to the batch
    c = d.take(2, 100)
    assert c == Range(0, 4, 2)
    e = d.take(3, 100)
    assert e == Range(1, 0, 10)  # epoch 1 starts while epoch 0 is still in flight
    assert d.take(4, 1) is None  # epoch 2 waits for epoch 0 to complete
    for w, r in ((1, b), (1, Range(0, 0, 4))):
        assert not d.done(w, r)
    assert d.done(2, c) and d.completed == [0]
    assert d.take(4, 100) == Range(2, 0, 10)
    assert torch.equal(d.permutation(1), Dispatcher(10, 3, 0).permutation(1))


def test_a_resumed_run_starts_from_the_lowest_epoch_still_under_way():
    """Epoch 1 can complete while the device still trains a range of epoch 0: a checkpoint
    taken then resumes at epoch 0, which is not complete, not at 2."""
    d = Dispatcher(10, epochs=3, seed=0)
    assert d.first_unfinished(0) == 0
    slow = d.take(0, 8)  # the device, on epoch 0
    while (r := d.take(1, 1)) is not None:
        d.done(1, r)
    assert d.completed == [1] and d.left == {0: 8}
    assert d.first_unfinished(0) == 0
    d.done(0, slow)
    assert d.first_unfinished(0) == 2


def test_a_lost_cpu_worker_stops_counting_in_the_cpu_rate():
    """After one of two CPU workers dies the device batch follows the one left: the update
    ratio stays at its target (device 20 ms + b / 5000, CPU batch 4 in 40 ms: b = 100 for
    ratio 1 with one CPU worker, 50 while there were two)."""
    res = run(adaptive=True, budget=0.9, cpus=2, epochs=3, device=(0.02, 5000.0),
              cpu=(0.02, 200.0), lose={2: 2.0})  # fmt: skip
    assert_exactly_once(res)
    late = res["order"][-len(res["order"]) // 3 :]
    assert late.count(0) / late.count(1) == pytest.approx(1.0, rel=0.15)
    assert res["trace"][-1] == pytest.approx(100, rel=0.15)


def test_progress_names_the_samples_in_the_weights_and_a_resume_trains_the_rest_once():
    """A worker trains its ranges in order; the first `landed` of them are in the weights
    though their `done` has not come. A run of fewer epochs than the frontier's keeps the
    later epoch's progress for the next one."""
    d = Dispatcher(10, epochs=3, seed=0)
    a, b, c = d.take(0, 4), d.take(1, 4), d.take(0, 4)
    nxt = d.take(0, 4)
    assert (a, b, c, nxt) == (Range(0, 0, 4), Range(0, 4, 4), Range(0, 8, 2), Range(1, 0, 4))
    d.done(1, b)
    assert d.progress({0: 2}) == {"epoch": 1, "cursor": 4, "todo": [[1, 0, 4]], "samples": 10}
    state = d.progress({0: 1})  # epoch 0 not complete: c is still to do
    assert state == {"epoch": 1, "cursor": 4, "todo": [[0, 8, 2], [1, 0, 4]], "samples": 10}
    assert not progress_done(state)

    def drain(disp):
        seen = []
        while (r := disp.take(0, 3)) is not None:
            disp.done(0, r)
            seen.append(r)
        return seen

    one = Dispatcher(10, 1, 0, first_epoch=0, progress=state)  # epoch 0 only
    assert drain(one) == [Range(0, 8, 2)] and one.all_done()
    assert one.first_unfinished(0) == 1
    later = one.progress()
    assert later == {"epoch": 1, "cursor": 4, "todo": [[1, 0, 4]], "samples": 10}
    two = Dispatcher(10, 1, 0, first_epoch=1, progress=later)
    assert drain(two) == [Range(1, 0, 3), Range(1, 3, 1), Range(1, 4, 3), Range(1, 7, 3)]
    assert two.all_done() and two.completed == [1]
    assert progress_done(two.progress())  # only complete epochs: the next may use any data
