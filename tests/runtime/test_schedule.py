"""Action notation and the policies that order a stage's operations."""

from __future__ import annotations

import pytest

from myelin import Action, ConfigError
from myelin.runtime.schedule import ForwardOnly, Ready, fixed_order, make_policy


@pytest.mark.parametrize(
    "text", ["1F3", "0B0", "12F105", "1SEND_F3", "2RECV_B0", "3OPT", "1I3", "0W12"]
)
def test_action_string_round_trips(text):
    assert str(Action.parse(text)) == text


def test_action_fields_and_bad_text():
    assert Action.parse("1SEND_F3") == Action(1, "SEND_F", 3)
    assert str(Action(1, "F", 3)) == "1F3"
    with pytest.raises(ValueError, match="'F3' is not an action"):
        Action.parse("F3")


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert [str(a) for a in fixed_order("gpipe", 1, 2, 3)] == [
        "1F0",
        "1F1",
        "1F2",
        "1B0",
        "1B1",
        "1B2",
    ]


def test_1f1b_warms_up_by_distance_to_the_last_stage():
    order = [str(a) for a in fixed_order("1f1b", 0, 3, 4)]
    assert order == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    last = [str(a) for a in fixed_order("1f1b", 2, 3, 4)]
    assert last == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(1, 1), (2, 8), (4, 3), (4, 4)])
def test_fixed_orders_run_each_microbatch_once_forward_before_backward(name, stages, m):
    for s in range(stages):
        order = fixed_order(name, s, stages, m)
        assert sorted(str(a) for a in order) == sorted(
            [f"{s}F{i}" for i in range(m)] + [f"{s}B{i}" for i in range(m)]
        )
        for i in range(m):
            assert order.index(Action(s, "F", i)) < order.index(Action(s, "B", i))


def test_message_driven_prefers_backward_then_oldest_and_bounds_stage0_window():
    policy = make_policy("message-driven", max_inflight=2)
    ready = Ready(0, 2, 8, forward=set(range(8)))
    assert policy.pick(ready) == Action(0, "F", 0)
    for mb in (0, 1):
        ready.forward.discard(mb)
        ready.ran("F", mb)
    assert policy.pick(ready) is None  # window of 2 full: wait for a gradient
    assert policy.waiting_for(ready) == Action(0, "B", 0)
    ready.backward = {1, 0}
    assert policy.pick(ready) == Action(0, "B", 0)


def test_fixed_policy_waits_for_its_next_action():
    policy = make_policy("gpipe", max_inflight=2)
    ready = Ready(1, 2, 2)
    policy.begin_step(ready)
    ready.forward = {1}
    assert policy.pick(ready) is None and policy.waiting_for(ready) == Action(1, "F", 0)
    ready.forward = {0, 1}
    assert policy.pick(ready) == Action(1, "F", 0)


def test_unknown_schedule_is_rejected():
    with pytest.raises(ConfigError, match="schedule='zigzag' must be one of"):
        make_policy("zigzag", 1)


def test_forward_only_runs_every_forward_oldest_first_and_waits_for_the_loss():
    policy = ForwardOnly()
    ready = Ready(0, 2, 3, forward={2, 0})
    assert not policy.trains and policy.pick(ready) == Action(0, "F", 0)  # no window
    for mb in (0, 2):
        ready.forward.discard(mb)
        ready.ran("F", mb)
    assert policy.pick(ready) is None and policy.waiting_for(ready) == Action(0, "F", 1)
    ready.ran("F", 1)
    assert not policy.done(ready)  # stage 0 of 2: the last stage still owes the loss
    assert policy.waiting_for(ready) is None
    ready.loss = 1.5
    assert policy.done(ready)
    last = Ready(1, 2, 1)
    last.ran("F", 0)
    assert policy.done(last)  # the last stage computes the loss itself


def test_training_policies_are_done_when_every_backward_ran():
    for name in ("message-driven", "zero-bubble", "gpipe", "1f1b"):
        policy, ready = make_policy(name, 1), Ready(1, 2, 2)
        assert policy.trains and not policy.done(ready)
        for kind, mb in (("F", 0), ("F", 1), ("B", 0)):
            ready.ran(kind, mb)
        assert not policy.done(ready)
        ready.ran("B", 1)
        assert policy.done(ready)


def _run(ready: Ready, action: Action, waits: bool = True) -> None:
    """What the loop does after running `action` (an I whose stage deferred a W: `waits`)."""
    (ready.forward if action.kind == "F" else ready.backward).discard(action.microbatch)
    ready.ran(action.kind, action.microbatch)
    if action.kind == "I" and waits:
        ready.weights.append(action.microbatch)


def test_zero_bubble_runs_i_first_then_forwards_and_fills_waits_with_w():
    policy = make_policy("zero-bubble", max_inflight=2)
    ready = Ready(1, 3, 3, forward={0, 1})
    assert policy.splits and policy.pick(ready) == Action(1, "F", 0)
    _run(ready, Action(1, "F", 0))
    ready.backward.add(0)
    assert policy.pick(ready) == Action(1, "I", 0)  # before the forward that is ready too
    _run(ready, Action(1, "I", 0))
    assert policy.pick(ready) == Action(1, "F", 1)  # a forward before the W
    _run(ready, Action(1, "F", 1))
    assert policy.pick(ready) == Action(1, "W", 0)  # nothing else ready: the W
    _run(ready, Action(1, "W", 0))
    assert policy.pick(ready) is None and policy.waiting_for(ready) == Action(1, "B", 1)
    ready.backward.add(1)
    _run(ready, policy.pick(ready), waits=False)  # an I that left no W (no linear layer)
    assert ready.weights == [] and ready.backwards_done == 2


def test_zero_bubble_stage0_runs_its_last_backward_whole_after_every_w():
    policy, ready = make_policy("zero-bubble", max_inflight=2), Ready(0, 2, 2, forward={0, 1})
    for action in (Action(0, "F", 0), Action(0, "F", 1)):
        _run(ready, action)
    ready.backward = {0, 1}
    assert policy.pick(ready) == Action(0, "I", 0)
    _run(ready, Action(0, "I", 0))
    assert policy.pick(ready) == Action(0, "W", 0)  # the W before the step's last backward
    _run(ready, Action(0, "W", 0))
    assert not policy.done(ready) and policy.pick(ready) == Action(0, "B", 1)
    _run(ready, Action(0, "B", 1))
    assert policy.done(ready)


def test_a_step_is_not_done_while_a_w_waits():
    policy, ready = make_policy("zero-bubble", max_inflight=1), Ready(1, 2, 1)
    _run(ready, Action(1, "F", 0))
    _run(ready, Action(1, "I", 0))
    assert not policy.done(ready) and policy.pick(ready) == Action(1, "W", 0)
    _run(ready, Action(1, "W", 0))
    assert policy.done(ready)
