"""The event loop against a scripted transport: what it runs, sends, drops and reports."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from myelin import DeadlineError, MyelinError, RemoteError
from myelin.runtime.group import Layout, World
from myelin.runtime.loop import EventLoop, LoopConfig
from myelin.runtime.messages import Message
from myelin.runtime.schedule import make_policy
from myelin.runtime.stage import Stage

M = 3


class ScriptedTransport:
    """Delivers a fixed list of messages, one per poll, and records what is sent."""

    def __init__(self, inbox):
        self.inbox = list(inbox)
        self.sent = []

    def poll(self, timeout_s):
        return [self.inbox.pop(0)] if self.inbox else []

    def send(self, dst, msg):
        self.sent.append((dst, msg))

    def pending_sends(self):
        return 0


def last_stage_loop(inbox, timeout_s=5.0):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3))
    world = World(rank=1, layout=Layout(2, 1), device=torch.device("cpu"))
    stage = Stage(module, 1, 2, world.device, F.cross_entropy)
    transport = ScriptedTransport(inbox)
    loop = EventLoop(
        stage,
        world,
        transport,
        make_policy("message-driven", 2),
        None,
        LoopConfig(microbatches=M, timeout_s=timeout_s, poll_s=0.001),
    )
    return loop, transport, module


def act(mb, step=0, src=0, stage=1, x=None):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(mb)) if x is None else x
    return Message("activation", src, step, mb, stage, [x])


def test_last_stage_runs_each_microbatch_and_sends_the_losses_with_its_last_gradient():
    """The losses are read once, at the step's last backward (on a GPU, one wait for the
    device a step instead of one a microbatch), and travel with that gradient."""
    inbox = [act(i) for i in range(M)]
    loop, transport, module = last_stage_loop(inbox)
    ref = copy.deepcopy(module)
    targets = [torch.tensor([0, 1]), torch.tensor([2, 0]), torch.tensor([1, 1])]
    loss = loop.run_step(0, None, targets)
    losses = []
    for i, msg in enumerate(inbox):
        x = msg.tensors[0].clone().requires_grad_(True)
        li = F.cross_entropy(ref(x), targets[i])
        (li / M).backward()
        losses.append(li.item())
        dst, sent = transport.sent[i]
        assert (dst, sent.kind, sent.microbatch, sent.stage) == (0, "gradient", i, 0)
        assert sent.meta == {"index": [0], **({"losses": losses} if i == M - 1 else {})}
        assert torch.equal(sent.tensors[0], x.grad)
    assert transport.sent[-1][1].meta["losses"] == losses
    assert loss == sum(losses) / M
    for a, b in zip(module.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_unexpected_messages_are_dropped_and_counted_and_change_nothing():
    good = [act(i) for i in range(M)]
    junk = [
        act(0),  # duplicate of microbatch 0
        act(7),  # microbatch out of range
        act(1, stage=0),  # addressed to another stage
        act(2, step=0),  # replayed below as stale in step 1
        Message("gradient", 0, 0, 0, 1, [torch.zeros(2, 3)], {"index": [0], "loss": 1.0}),
        Message("control", 0, 0, 0, 1, [], {"op": "dance"}),
    ]
    inbox = [good[0], *junk[:3], good[1], *junk[4:], good[2]]
    loop, transport, _ = last_stage_loop(inbox)
    targets = [torch.tensor([0, 1])] * M
    clean_loop, _, _ = last_stage_loop(list(good))
    assert loop.run_step(0, None, targets) == clean_loop.run_step(0, None, targets)
    assert loop.stats.rejected == 5
    transport.inbox = [junk[3]] + [act(i, step=1) for i in range(M)]
    loop.run_step(1, None, targets)
    assert loop.stats.rejected == 6  # the stale step-0 message


def test_messages_for_a_later_step_wait_for_it():
    inbox = [act(0), act(0, step=1), act(1), act(2), act(1, step=1), act(2, step=1)]
    loop, _, _ = last_stage_loop(inbox)
    targets = [torch.tensor([0, 1])] * M
    loop.run_step(0, None, targets)
    assert loop.stats.early >= 1
    loop.run_step(1, None, targets)
    assert loop.stats.rejected == 0 and loop.stats.forwards == 2 * M


def test_abort_from_a_peer_raises_remote_error_naming_it():
    abort = Message("control", 0, 0, 0, 1, [], {"op": "abort", "error": "ValueError: boom"})
    loop, _, _ = last_stage_loop([act(0), abort])
    with pytest.raises(RemoteError, match="rank 0 failed: ValueError: boom"):
        loop.run_step(0, None, [torch.tensor([0, 1])] * M)


def test_waiting_past_the_deadline_names_rank_stage_step_microbatch_and_peer():
    loop, _, _ = last_stage_loop([act(0)], timeout_s=0.2)
    with pytest.raises(DeadlineError) as info:
        loop.run_step(0, None, [torch.tensor([0, 1])] * M)
    text = str(info.value)
    for part in (
        "rank 1 (stage 1, replica 0)",
        "step 0",
        "activation of microbatch 1",
        "from rank 0",
        "1F1",
    ):
        assert part in text, (part, text)


def test_gradient_with_the_wrong_shape_is_a_clear_error():
    bad = Message("gradient", 1, 0, 0, 0, [torch.zeros(2, 7)], {"index": [0], "losses": [0.5]})
    loop = first_stage_loop([bad])
    with pytest.raises(
        Exception,
        match=r"gradient of output 0 of microbatch 0 has shape \(2, 7\), expected \(2, 5\)",
    ):
        loop.run_step(0, [(torch.randn(2, 4),)], None)


class AfterForwards(ScriptedTransport):
    """Delivers its messages only once every forward's activation has gone out (as rank 1
    would answer them), one per poll."""

    def __init__(self, inbox, forwards):
        super().__init__(inbox)
        self.forwards = forwards

    def poll(self, timeout_s):
        return super().poll(timeout_s) if len(self.sent) >= self.forwards else []


def first_stage_loop(inbox: list[Message], microbatches: int = 1) -> EventLoop:
    """Stage 0 of 2 (Linear(4, 5)), fed `inbox` as if rank 1 had sent it."""
    torch.manual_seed(0)
    world = World(rank=0, layout=Layout(2, 1), device=torch.device("cpu"))
    stage = Stage(nn.Linear(4, 5), 0, 2, world.device, F.cross_entropy)
    return EventLoop(
        stage,
        world,
        AfterForwards(inbox, microbatches),
        make_policy("message-driven", microbatches),
        None,
        LoopConfig(microbatches=microbatches, timeout_s=5, poll_s=0.001),
    )


def grad(mb: int, meta: dict) -> Message:
    return Message("gradient", 1, 0, mb, 0, [torch.zeros(2, 5)], meta)


@pytest.mark.parametrize("losses", [[0.5], [1, 2], "0.5,0.25", [0.5, "0.25"], {"0": 0.5}], ids=str)
def test_losses_that_are_not_the_steps_floats_are_named(losses):
    loop = first_stage_loop([grad(0, {"index": [0]}), grad(1, {"index": [0], "losses": losses})], 2)
    with pytest.raises(
        MyelinError, match=r"meta\.losses=.*expected the step's 2 microbatch losses"
    ):
        loop.run_step(0, [(torch.randn(2, 4),), (torch.randn(2, 4),)], None)


def test_a_step_whose_gradients_carry_no_losses_is_named_not_averaged():
    loop = first_stage_loop([grad(0, {"index": [0]}), grad(1, {"index": [0]})], 2)
    with pytest.raises(MyelinError, match=r"losses of microbatches \[\] of 2; the next stage"):
        loop.run_step(0, [(torch.randn(2, 4),), (torch.randn(2, 4),)], None)


def test_the_first_stage_returns_the_losses_the_last_gradient_carried():
    inbox = [grad(1, {"index": [0]}), grad(0, {"index": [0], "losses": [0.25, 0.75]})]
    loop = first_stage_loop(inbox, 2)
    assert loop.run_step(0, [(torch.randn(2, 4),), (torch.randn(2, 4),)], None) == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_later_stage_takes_an_activation_in_the_dtype_it_was_sent(dtype):
    """A float64 side input (positions, say) stays float64 across a boundary, as in one
    process, under any precision; only stage 0's inputs take the stage's dtype."""
    from myelin.runtime.stage import Stage

    later = Stage(
        nn.Linear(4, 5).to(dtype), 1, 2, torch.device("cpu"), F.cross_entropy, dtype=dtype
    )
    sent = torch.randn(3, 4, dtype=torch.float64)
    got = later._receive(sent)
    assert got.dtype == torch.float64 and got.requires_grad and torch.equal(got, sent)
    first = Stage(
        nn.Linear(4, 5).to(dtype), 0, 2, torch.device("cpu"), F.cross_entropy, dtype=dtype
    )
    assert first._receive(sent).dtype == dtype


def test_a_list_crossing_to_the_next_stage_is_refused_saying_to_return_a_tuple():
    """In one process a Sequential passes a list to the next layer as one argument; across
    a boundary a tuple's tensors become separate arguments: a list is refused, not split."""
    from myelin.runtime.stage import Stage

    class Pair(nn.Module):
        def forward(self, x):
            return [x, x + 1]

    first = Stage(Pair(), 0, 2, torch.device("cpu"), F.cross_entropy)
    with pytest.raises(MyelinError, match="stage 0's last layer returned a list"):
        first.evaluate((torch.randn(2, 4),))
    last = Stage(Pair(), 1, 2, torch.device("cpu"), lambda out, y: out[1].sum())
    assert last.evaluate((torch.zeros(2, 4),), None) == 8.0  # the loss takes it whole
