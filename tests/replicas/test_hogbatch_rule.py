"""Adaptive Hogbatch's rule as pure functions (myelin/replicas/hogbatch_rule.py).

python -m pytest -q tests/replicas/test_hogbatch_rule.py
"""

from __future__ import annotations

import math
import random

import pytest

from myelin.replicas.hogbatch_rule import (
    MIN_OVERHEAD,
    Controller,
    budget_floor,
    budget_overhead,
    choose_device_batch,
    efficiency,
    fit_update_time,
    ratio_batch,
)

O_D, S_D = 0.02, 50_000.0  # device: 20 ms per update, 50k samples/s


def test_fit_recovers_overhead_and_throughput_from_noisy_times():
    rng = random.Random(0)
    bs = [rng.choice([64, 128, 256, 512, 1024]) for _ in range(64)]
    ts = [(O_D + b / S_D) * (1 + rng.uniform(-0.02, 0.02)) for b in bs]
    o, s = fit_update_time(bs, ts)
    assert o == pytest.approx(O_D, rel=0.05) and s == pytest.approx(S_D, rel=0.05)


def test_fit_with_one_batch_size_predicts_that_batch():
    o, s = fit_update_time([4, 4, 4], [0.01, 0.012, 0.011])
    assert o == 0.0 and 4 / s == pytest.approx(0.011)


def test_budget_to_zero_gives_the_largest_batch():
    assert budget_floor(O_D, S_D, 0.0) == math.inf
    b = choose_device_batch(4096, O_D, S_D, 500.0, ratio=1.0, budget=0.0, lo=8, hi=4096)
    assert b == 4096
    c = Controller(lo=8, hi=4096, ratio=1.0, budget=0.0, adaptive=True)
    for _ in range(10):
        c.observe(1, 4, 0.002, device=False)
        c.observe(0, c.batch, O_D + c.batch / S_D, device=True)
    assert c.trace == [4096] and c.batch == 4096


@pytest.mark.parametrize("overhead", [0.0, -0.01])
@pytest.mark.parametrize("budget", [1e-9, 1e-6])
def test_a_tiny_budget_keeps_the_largest_batch_when_the_fit_finds_no_overhead(overhead, budget):
    # a negative intercept (noise, superlinear times) was clipped to 0: the floor was 0
    # whatever the budget, so budget 1e-9 went to the ratio batch as budget 1 does
    got = choose_device_batch(4096, overhead, 1e5, 1000.0, ratio=1.0, budget=budget,
                              lo=64, hi=4096)  # fmt: skip
    assert got == 4096
    assert budget_overhead(overhead, 1e5, 4096) == pytest.approx(MIN_OVERHEAD * 4096 / 1e5)
    assert budget_overhead(O_D, S_D, 4096) == O_D  # a real overhead is the fit's


@pytest.mark.parametrize("budget", [1e-6, 0.01, 0.3])
def test_superlinear_device_times_keep_a_small_budget_near_the_largest_batch(budget):
    c = Controller(lo=64, hi=4096, ratio=1.0, budget=budget, adaptive=True)
    for _ in range(8):
        c.observe(1, 4, 0.001, device=False)  # a CPU worker: 1000 updates/s
    for _ in range(30):
        b = c.batch
        c.observe(0, b, 1e-5 * b * (1 + b / 4096), device=True)  # no overhead, superlinear
    assert c.fit[0] == 0.0  # the fit finds none
    if budget < 0.3:  # 1e-6: 4096, 0.01: about 0.99 x 4096
        assert min(c.trace[2:]) >= 0.98 * 4096, c.trace
    else:  # a real budget still lets the batch go where the ratio wants it
        assert c.batch < 4096 / 10


@pytest.mark.parametrize("cpu_rate", [5.0, 20.0, 40.0])
def test_ratio_met_when_feasible(cpu_rate):
    # undamped (current is already near), generous budget: device rate / cpu rate == ratio
    for ratio in (0.5, 1.0, 2.0):
        if ratio * cpu_rate >= 1 / O_D:  # the device cannot make that many updates
            assert ratio_batch(O_D, S_D, cpu_rate, ratio) <= 0
            continue
        want = ratio_batch(O_D, S_D, cpu_rate, ratio)
        b = choose_device_batch(round(want), O_D, S_D, cpu_rate, ratio=ratio, budget=1.0,
                                lo=1, hi=10**6)  # fmt: skip
        got = (1 / (O_D + b / S_D)) / cpu_rate
        assert got == pytest.approx(ratio, rel=0.05)


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.3, 0.5, 0.9])
def test_efficiency_never_under_the_budget(budget):
    for cpu_rate in (1.0, 10.0, 100.0, 1000.0):
        b = choose_device_batch(10**6, O_D, S_D, cpu_rate, ratio=1.0, budget=budget,
                                lo=1, hi=10**6)  # fmt: skip
        assert efficiency(b, O_D, S_D) >= 1 - budget - 1e-6


def test_damping_at_most_2x_per_adjustment():
    assert choose_device_batch(1024, O_D, S_D, 1000.0, ratio=1.0, budget=1.0, lo=1,
                               hi=8192) == 512  # fmt: skip  # wants ~0: halves
    assert choose_device_batch(64, O_D, S_D, 0.01, ratio=1.0, budget=1.0, lo=1,
                               hi=8192) == 128  # fmt: skip  # wants inf: doubles
    assert choose_device_batch(100, O_D, S_D, 1000.0, ratio=1.0, budget=1.0, lo=80,
                               hi=8192) == 80  # fmt: skip  # clamped at lo


def test_controller_converges_to_the_ratio_and_tracks_a_speed_change():
    c = Controller(lo=8, hi=8192, ratio=1.0, budget=0.9, adaptive=True)
    cpu_t = 0.004  # two CPU workers at 250 updates/s each -> U_c = 500

    def run(n, s_d):
        for _ in range(n):
            for w in (1, 2):
                c.observe(w, 4, cpu_t, device=False)
            c.observe(0, c.batch, O_D + c.batch / s_d, device=True)

    run(30, S_D)
    # device rate 1/(0.02 + b/50000) cannot reach 500/s: the budget floor holds it
    assert c.batch == max(8, math.ceil(budget_floor(O_D, S_D, 0.9)))  # 111.1: 111 is under
    cpu_t = 0.1  # CPU slows to 20 updates/s -> ratio batch = 50000 * (1/20 - 0.02) = 1500
    run(30, S_D)
    assert c.batch == pytest.approx(1500, rel=0.05)
    state = c.state_dict()
    d = Controller(lo=8, hi=8192, ratio=1.0, budget=0.9, adaptive=True)
    d.load_state_dict(state)
    assert d.state_dict() == state


def test_the_batch_is_rounded_up_to_its_floor_and_halves_at_most_to_half():
    floor = budget_floor(O_D, S_D, 0.3)  # 2333.3: 2333 would be under the budget
    b = choose_device_batch(4096, O_D, S_D, 1e6, ratio=1.0, budget=0.3, lo=1, hi=8192)
    assert b == math.ceil(floor) and efficiency(b, O_D, S_D) >= 0.7
    assert choose_device_batch(5, O_D, S_D, 1e6, ratio=1.0, budget=1.0, lo=1, hi=100) == 3


@pytest.mark.parametrize("budget", [0.1, 0.6])
def test_a_window_of_one_device_batch_size_keeps_the_last_fit(budget):
    """Three device ranges are queued ahead (the runner's AHEAD), so the probe's time comes
    back late and a batch can hold for a whole window: with one batch size in the window
    the line is not identifiable, and a fit of it (no overhead: a budget floor of 0) must
    not drive the batch under the budget. Before, budget 0.1 went 4096 -> 1024 -> 512."""
    c = Controller(lo=16, hi=4096, ratio=1.0, budget=budget, adaptive=True)
    queued = [c.batch] * 3
    for _ in range(60):
        for _ in range(20):
            c.observe(1, 4, 0.004, device=False)  # CPU: 250 updates/s
        b = queued.pop(0)
        c.observe(0, b, O_D + b / S_D, device=True)
        queued.append(c.batch)
    need = min(math.ceil(budget_floor(O_D, S_D, budget)), 4096)  # 0.1: 9000, past hi
    assert min(c.trace[4:]) >= need, c.trace
    state = c.state_dict()
    d = Controller(lo=16, hi=4096, ratio=1.0, budget=budget, adaptive=True)
    d.load_state_dict(state)
    assert d.fit == c.fit and d.state_dict() == state


@pytest.mark.parametrize("overhead", [0.0, 0.05, 0.1])
def test_a_batch_that_costs_no_time_per_sample_gives_a_batch_not_nan(overhead):
    # 1 / (ratio * cpu_rate) = 0.05 s: inf * 0 was nan, and ceil(nan) a ValueError
    got = choose_device_batch(64, overhead, math.inf, 20.0, ratio=1.0, budget=0.3, lo=8, hi=512)
    assert 8 <= got <= 512
    assert budget_floor(0.0, math.inf, 0.3) == 0.0
    assert not math.isnan(ratio_batch(overhead, math.inf, 20.0, 1.0))
