"""Tied gradients added per microbatch (runtime/tied.py): the first holder ends with the
bits one process gets, and its inbox waits for the later holders' pieces (well under 1 s)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from myelin.profile.timeline import Timeline
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import Layout, World
from myelin.runtime.inbox import Inbox, LoopStats
from myelin.runtime.messages import Message
from myelin.runtime.schedule import Ready
from myelin.runtime.stage import Stage
from myelin.runtime.tied import MicrobatchTies, Tied

V, D, M = 50, 8, 4


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, V, (3, 5), generator=g), torch.randint(0, V, (3, 5), generator=g))
        for _ in range(M)
    ]


def one_process_grad(weight):
    """An embedding tied to its head, gradient accumulated over M microbatches."""
    w = nn.Parameter(weight.clone())
    for ids, y in batches():
        logits = F.embedding(ids, w).tanh() @ w.T
        (F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)) / M).backward()
    return w.grad


def test_the_first_holder_adds_each_microbatchs_pieces_as_one_process_does():
    torch.manual_seed(0)
    weight = torch.randn(V, D)
    w0, w1 = nn.Parameter(weight.clone()), nn.Parameter(weight.clone())  # stage 0's, stage 1's
    first = MicrobatchTies(0, [Tied(None, [w0], (0, 1), [0])])
    last = MicrobatchTies(1, [Tied(None, [w1], (0, 1), [0])])
    assert first.sources == {1} and last.sources == set()
    summed_once = [torch.zeros(V, D), torch.zeros(V, D)]  # what tied_grads="step" adds up
    for ids, y in batches():
        hidden = F.embedding(ids, w0).tanh()  # stage 0
        received = hidden.detach().requires_grad_(True)  # stage 1
        loss = F.cross_entropy((received @ w1.T).reshape(-1, V), y.reshape(-1)) / M
        last.before_backward({})
        loss.backward()
        [(dest, keys, pieces)] = last.after_backward()
        assert (dest, keys) == (0, [0])
        summed_once[1] += pieces[0]
        e = torch.autograd.grad(hidden, w0, received.grad, retain_graph=True)[0]
        summed_once[0] += e
        first.before_backward({1: (keys, pieces)})
        hidden.backward(received.grad)
        assert first.after_backward() == []
    want = one_process_grad(weight)
    assert torch.equal(w0.grad, want)
    assert torch.equal(w1.grad, torch.zeros(V, D))  # the step's sum adds zeros from here
    assert not torch.equal(summed_once[0] + summed_once[1], want)  # the old way rounds apart


def test_a_backward_waits_for_the_later_holders_pieces_and_strangers_are_refused():
    # three stages; stage 0 and stage 2 hold the tied weight, stage 1 only relays activations
    w = nn.Parameter(torch.randn(V, D))
    ties = MicrobatchTies(0, [Tied(None, [w], (0, 2), [0])])
    world = World(rank=0, layout=Layout(3, 1), device=torch.device("cpu"))
    stage = Stage(nn.Embedding(V, D), 0, 3, world.device, F.cross_entropy)
    stage.forward(0, (torch.randint(0, V, (2, 3)),))
    inbox = Inbox(
        stage,
        world,
        None,
        M,
        LoopStats(),
        timeline=Timeline(0, 0, enabled=False),
        flight=FlightRecorder(0),
        ties=ties,
    )
    ready = Ready(0, 3, M)
    inbox.begin(0, ready, {})
    grad = Message("gradient", 1, 0, 0, 0, [torch.zeros(2, 3, D)], {"index": [0], "loss": 1.0})
    inbox.handle([grad], ready)
    assert ready.backward == set()  # the gradient came, stage 2's piece has not
    assert inbox.pieces_missing(ready) == (
        "; gradients came, tied gradients did not, for microbatch 0 from rank 2"
    )
    stranger = Message("tied", 1, 0, 0, 0, [torch.zeros(V, D)], {"keys": [0]})
    assert inbox.handle([stranger], ready) == 0
    assert inbox.stats.rejected == 1 and ready.backward == set()
    piece = Message("tied", 2, 0, 0, 0, [torch.ones(V, D)], {"keys": [0]})
    assert inbox.handle([piece], ready) == 1
    assert ready.backward == {0}
    assert inbox.pieces_missing(ready) == ""
    assert inbox.handle([piece], ready) == 0  # a duplicate
    assert inbox.stats.rejected == 2
    keys, tensors = inbox.pieces[0][2]
    assert keys == [0] and torch.equal(tensors[0], torch.ones(V, D))


def test_frozen_tied_parameters_take_no_hooks_and_expect_no_pieces():
    """A frozen tied embedding has no gradient to add: building the ties must not fail
    (register_hook raises on a tensor that does not require grad)."""
    w = nn.Parameter(torch.randn(V, D), requires_grad=False)
    first = MicrobatchTies(0, [Tied(None, [w], (0, 1), [0])])
    last = MicrobatchTies(1, [Tied(None, [w], (0, 1), [0])])
    assert first.sources == set() and first.expected == {}
    last.before_backward({})
    assert last.after_backward() == []  # nothing to send


class _Grads:
    """An updater's gradients under bf16: each parameter's fp32 gradient lives in a carrier."""

    def __init__(self, params):
        self.carriers = {id(p): torch.zeros(p.shape, requires_grad=True) for p in params}

    def holders_of(self, params):
        return [self.carriers[id(p)] for p in params]


def test_pieces_no_hook_took_go_where_the_fp32_gradient_accumulates():
    """The first holder's copy unused in a microbatch: the later holders' pieces are added
    by hand, into the fp32 carrier an updater keeps under bf16, on the parameter's device."""
    w = nn.Parameter(torch.randn(V, D, dtype=torch.bfloat16))
    grads = _Grads([w])
    updater = type("Updater", (), {"grads": grads})()
    first = MicrobatchTies(0, [Tied(None, [w], (0, 1), [0])], updater)
    piece = torch.randn(V, D)
    for _ in range(2):
        first.before_backward({1: ([0], [piece])})
        assert first.after_backward() == []
    carrier = grads.holders_of([w])[0]
    assert torch.equal(carrier.grad, piece + piece) and w.grad is None
