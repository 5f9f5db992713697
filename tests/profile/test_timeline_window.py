"""A profiled run keeps a bounded window of spans plus running totals (issue 17.10): the
figures over the whole run stay those of every span, while memory stays flat."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

import myelin
from myelin.profile.attribution import MESSAGE_CAUSES
from myelin.profile.report import ProfileConfig, ProfileReport, collect
from myelin.profile.timeline import Timeline


def synthetic(timeline: Timeline, steps: int, seed: int = 0) -> None:
    """Forwards, backwards, waits of several causes, sends and an optimizer step per step,
    with gaps (host overhead) between them and spans that cross step boundaries."""
    rng = random.Random(seed)
    t = 0.0
    for step in range(steps):
        for mb in range(4):
            for kind, cause in (("forward", None), ("wait", "bubble"), ("backward", None)):
                d = rng.uniform(0.001, 0.01)
                timeline.add(kind, f"0{kind[0].upper()}{mb}", t, t + d, step, cause=cause)
                t += d + rng.uniform(0, 0.002)
            timeline.add(
                "send", f"0SEND_F{mb}", t - 0.001, t + 0.0005, step, peer=1, track="peer 1"
            )
        timeline.add("allreduce", "0ALLREDUCE", t, t + 0.004, step, cause="collective_wait")
        t += 0.004
        timeline.add("optimizer", "0OPT", t, t + 0.003, step)
        # the next step's first wait begins before this step's last send has ended
        timeline.add("send", "0SEND_B3", t + 0.002, t + 0.006, step, peer=1, track="peer 1")
        t += 0.003 + rng.uniform(0, 0.003)


def summary_of(timeline: Timeline, warmup: int = 1) -> dict:
    return ProfileReport([collect(timeline)], warmup_steps=warmup).summary()["ranks"][0]


@pytest.mark.parametrize("window", [1, 3, 10])
def test_a_window_keeps_the_figures_of_every_span(window):
    whole = Timeline(0, 0, device="cpu")
    kept = Timeline(0, 0, device="cpu", window_steps=window)
    for t in (whole, kept):
        synthetic(t, 40)
    assert len({s.step for s in kept.spans}) <= window + 1
    assert len(kept.spans) < len(whole.spans) * (window + 2) / 40
    assert kept.busy_s == whole.busy_s
    want, got = summary_of(whole), summary_of(kept)
    assert got["steps"] == want["steps"] == [1, 39]
    for figures in ("whole_run", None):
        w = want if figures is None else want[figures]
        g = got if figures is None else got[figures]
        for key in ("wall_s", "busy_frac", "comm_s", "exposed_send_frac", "overlap_frac"):
            assert g[key] == pytest.approx(w[key], rel=1e-9, abs=1e-12), (figures, key)
        # waits for messages are split by the replay (attribution.py) over the kept window
        # only; folded steps keep them whole as "bubble", so their sum is what must agree
        for cause, value in w["idle"].items():
            if cause not in MESSAGE_CAUSES:
                assert g["idle"][cause] == pytest.approx(value, rel=1e-9, abs=1e-12), cause
        messages = [sum(x["idle"].get(c, 0.0) for c in MESSAGE_CAUSES) for x in (g, w)]
        assert messages[0] == pytest.approx(messages[1], rel=1e-9, abs=1e-12)


def test_a_long_profiled_run_stays_bounded():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    profile = ProfileConfig(print_summary=False, window_steps=8)
    with myelin.Trainer(
        model,
        functools.partial(torch.optim.SGD, lr=0.1),
        F.mse_loss,
        microbatches=4,
        profile=profile,
    ) as t:
        x = torch.randn(8, 4)
        for _ in range(60):
            t.step(x, x)
        steps = {s.step for s in t.timeline.spans}
        assert len(steps) <= 9 and max(steps) == 59
        whole = t.profile_report().summary()["ranks"][0]["whole_run"]
        assert whole["busy_frac"] * whole["wall_s"] == pytest.approx(t.timeline.busy_s, rel=1e-6)


def test_window_steps_is_checked():
    with pytest.raises(myelin.ConfigError, match="window_steps=0"):
        ProfileConfig(window_steps=0)


def test_compute_seconds_up_to_a_time_are_those_of_every_span():
    """What fit's meter reads (idle_frac): compute seconds from the first record on, the
    same from a window as from every span, at any time after the last fold."""
    whole = Timeline(0, 0, device="cpu")
    kept = Timeline(0, 0, device="cpu", window_steps=2)
    for t in (whole, kept):
        synthetic(t, 30)
    end = max(s.end for s in whole.spans)
    for until in (kept.folded["until"], (kept.folded["until"] + end) / 2, end):
        assert kept.compute_s(until) == pytest.approx(whole.compute_s(until), rel=1e-9), until
