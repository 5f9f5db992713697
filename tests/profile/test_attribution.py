"""The replay behind the bubble: waits the schedule implies, and what latency adds.

Simulated GPipe pipelines of equal stages (as in test_report.py), but every message takes
`latency` seconds to arrive. The replay removes the latency, so the expected bubble is
(p-1)/(m+p-1) whatever it is; the observed waits split into that bubble and the rest.
"""

from __future__ import annotations

import pytest

from myelin.profile.attribution import MESSAGE_CAUSES, attribute
from myelin.profile.report import ProfileReport, account, collect
from myelin.profile.timeline import Timeline

F, B, OPT = 0.010, 0.020, 0.001


def gpipe(
    p: int, m: int, steps: int, latency: float, pause: float = 0.0, paused: int = -1
) -> list[Timeline]:
    """GPipe on equal stages; each message arrives `latency` after its operation ends;
    stage `paused` spends `pause` seconds in its script after each step."""
    lines = [Timeline(s, s) for s in range(p)]
    for line in lines:  # one clock for all, as ranks on one host share the monotonic clock
        line.wall_origin, line.origin = lines[0].wall_origin, lines[0].origin
    free = [0.0] * p
    for step in range(steps):
        for kind, order, span in (("F", range(p), F), ("B", reversed(range(p)), B)):
            done = [[0.0] * m for _ in range(p)]
            for s in order:
                t = free[s]
                src = s - 1 if kind == "F" else s + 1
                for i in range(m):
                    start = max(t, done[src][i] + latency) if 0 <= src < p else t
                    if start > t:
                        lines[s].add("wait", f"{s}RECV_{kind}{i}", t, start, step, cause="bubble",
                                      microbatch=i, peer=src)  # fmt: skip
                    name = "forward" if kind == "F" else "backward"
                    lines[s].add(name, f"{s}{kind}{i}", start, start + span, step, microbatch=i)
                    t = done[s][i] = start + span
                if kind == "B":
                    lines[s].add("optimizer", f"{s}OPT", t, t + OPT, step)
                    t += OPT + (pause if s == paused else 0.0)
                free[s] = t
    return lines


def figures(lines: list[Timeline], first_step: int = 1):
    records = [collect(t, replica=0) for t in lines]
    spans = {r["rank"]: t.spans for r, t in zip(records, lines)}
    out = attribute(records, spans, first_step)
    assert out is not None
    cut, expected = out
    rows = {}
    for r in spans:
        mine = [s for s in cut[r] if s.step >= first_step]
        window = (min(s.start for s in mine), max(s.end for s in mine))
        rows[r] = account(mine, *window)
    return rows, expected, spans, cut


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_without_latency_every_wait_is_the_bubble_of_the_formula(p, m):
    rows, expected, _, _ = figures(gpipe(p, m, steps=4, latency=0.0))
    want = (p - 1) / (m + p - 1)
    for r, row in rows.items():
        assert expected[r] == pytest.approx(want, abs=0.01)
        assert row["idle"]["bubble"] == pytest.approx(expected[r], abs=1e-6)
        for cause in ("latency", "slow_peer", "sync"):
            assert row["idle"].get(cause, 0.0) == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_latency_is_told_apart_from_the_bubble(p, m):
    latency = 0.002
    rows, expected, spans, cut = figures(gpipe(p, m, steps=4, latency=latency))
    want = (p - 1) / (m + p - 1)
    for r, row in rows.items():
        assert expected[r] == pytest.approx(want, abs=0.01), r  # the replay has no latency
        idle = row["idle"]
        assert idle["latency"] > 0, (r, idle)
        assert idle["bubble"] < expected[r]  # the same seconds, of a longer wall time
        assert row["busy_frac"] + sum(idle.values()) == pytest.approx(1, abs=1e-9)
        # cutting moves time between causes, never adds or loses any
        before = sum(s.end - s.start for s in spans[r] if s.cause == "bubble" and s.step >= 1)
        after = sum(s.end - s.start for s in cut[r] if s.cause in MESSAGE_CAUSES and s.step >= 1)
        assert after == pytest.approx(before, abs=1e-9)
    # stage 0 waits for gradients that stage 1 produced late, held up itself by latency
    assert rows[0]["idle"]["slow_peer"] > 0, rows[0]
    # the last stage waits at each step's start for stage 0, which finishes its step last
    assert rows[p - 1]["idle"]["sync"] > 0, rows[p - 1]


def test_the_whole_runs_latency_includes_the_warmup_steps():
    lines = gpipe(2, 4, steps=4, latency=0.002)
    records = [collect(t, replica=0) for t in lines]
    summary = ProfileReport.from_ranks(records, warmup_steps=1).summary()
    _, _, _, cut = figures(lines, first_step=0)  # attributed from the first step
    for r, row in enumerate(summary["ranks"]):
        whole = row["whole_run"]
        spans = cut[r]
        wall = max(x.end for x in spans) - min(x.start for x in spans)
        latency = sum(x.end - x.start for x in spans if x.cause == "latency") / wall
        assert whole["idle"]["latency"] == pytest.approx(latency, rel=1e-6), r
        # the warm-up step's waits are latency too, not bubble: more of it than steady state
        assert whole["idle"]["latency"] > 0


def test_without_every_rank_there_is_no_replay():
    lines = gpipe(2, 4, steps=3, latency=0.001)
    records = [collect(lines[0], replica=0) | {"stages": 2}]  # rank 1 sent nothing
    assert attribute(records, {0: lines[0].spans}, 1) is None


def ordered(orders: list[list[str]], times: dict[str, float], steps: int) -> list[Timeline]:
    """Each stage runs its actions (`F0`, `I0`, `W0`, `B0`) in the order given, each as soon
    as its message is here (no latency): an F after the previous stage's F, an I or B after
    the next stage's I or B of that microbatch; a W needs only its own I."""
    p = len(orders)
    lines = [Timeline(s, s) for s in range(p)]
    for line in lines:
        line.wall_origin, line.origin = lines[0].wall_origin, lines[0].origin
    free = [0.0] * p
    for step in range(steps):
        done: dict[tuple[int, str, int], float] = {}  # (stage, F or G(radient) or W, mb)
        at = [0] * p
        while any(at[s] < len(orders[s]) for s in range(p)):
            for s in range(p):
                while at[s] < len(orders[s]):
                    kind, mb = orders[s][at[s]][0], int(orders[s][at[s]][1:])
                    made = "G" if kind in "IB" else kind
                    src = s - 1 if kind == "F" else s + 1 if made == "G" else p
                    if 0 <= src < p and (src, made, mb) not in done:
                        break
                    start = max(free[s], done.get((src, made, mb), 0.0))
                    if start > free[s]:
                        lines[s].add("wait", f"{s}RECV{kind}{mb}", free[s], start, step,
                                     cause="bubble", microbatch=mb)  # fmt: skip
                    name = "forward" if kind == "F" else "backward"
                    end = start + times[kind]
                    lines[s].add(name, f"{s}{kind}{mb}", start, end, step, microbatch=mb)
                    done[(s, made, mb)] = free[s] = end
                    at[s] += 1
    return lines


def test_a_split_backward_s_w_needs_no_message_in_the_replay():
    """Zero-bubble on two stages: W runs in what would be bubble, and the replay knows an
    I is what the previous stage waits for (not the W that comes later)."""
    orders = [
        ["F0", "F1", "I0", "F2", "I1", "F3", "W0", "W1", "I2", "W2", "B3"],
        ["F0", "I0", "F1", "I1", "W0", "F2", "I2", "W1", "F3", "I3", "W2", "W3"],
    ]
    lines = ordered(orders, {"F": 0.010, "I": 0.010, "W": 0.008, "B": 0.018}, steps=3)
    rows, expected, _, _ = figures(lines)
    for r, row in rows.items():
        assert row["idle"]["bubble"] > 0.05, (r, row["idle"])
        assert expected[r] == pytest.approx(row["idle"]["bubble"], abs=1e-6), r
        for cause in ("latency", "slow_peer"):
            assert row["idle"].get(cause, 0.0) == pytest.approx(0, abs=1e-9), (r, cause)


def test_a_ranks_script_time_between_steps_is_its_peers_sync_not_bubble():
    """Stage 1 pauses 50 ms in its script after each step, and stage 0 waits longer for
    its gradients: all of that extra wait is sync (it was bubble, and expected), the
    bubble stays the schedule's (the run without pauses), and the replay still implies
    the formula's bubble."""
    steps = 5

    def waits(lines):
        _, expected, _, cut = figures(lines)
        seconds = {r: {c: sum(x.end - x.start for x in cut[r] if x.step >= 1
                              and x.kind == "wait" and x.cause == c) for c in MESSAGE_CAUSES}
                   for r in cut}  # fmt: skip
        return seconds, expected

    plain, _ = waits(gpipe(2, 4, steps, 0.0))
    paused, expected = waits(gpipe(2, 4, steps, 0.0, pause=0.050, paused=1))
    assert all(e == pytest.approx(1 / 5, abs=0.01) for e in expected.values()), expected
    extra = sum(paused[0].values()) - sum(plain[0].values())
    assert extra > 0.05  # 19 ms a step: stage 1 starts its forwards late
    assert paused[0]["bubble"] == pytest.approx(plain[0]["bubble"], abs=1e-9)
    assert paused[0]["sync"] == pytest.approx(extra, abs=1e-9)
    assert paused[0]["slow_peer"] == pytest.approx(0, abs=1e-9) and plain[0]["sync"] == 0
