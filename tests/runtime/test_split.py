"""Split backward (runtime/split.py): I now, W later, bit for bit one backward's gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from myelin.runtime.split import SplitBackward


class Mixed(nn.Module):
    """Linears of every shape ATen treats apart, beside weights that must stay in I: an
    embedding whose table is also a linear's weight (tied), a weight two linears share."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.a = nn.Linear(8, 12)  # 3-D contiguous input, bias
        self.b = nn.Linear(12, 8, bias=False)  # 3-D, no bias
        self.c = nn.Linear(8, 8)  # 2-D input
        self.e = nn.Linear(8, 8)  # 2-D column-major input
        self.d = nn.Linear(8, 8)  # non-contiguous 3-D input
        self.shared = nn.Linear(8, 8)  # called twice
        self.ln = nn.LayerNorm(8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, 8)
        x = self.b(F.gelu(self.a(x)))
        flat = x.reshape(-1, 8)  # 2-D inputs, row- and column-major
        x = (self.c(flat) + self.e(flat.t().contiguous().t())).view_as(x)
        x = self.d(x.transpose(0, 1)).transpose(0, 1)
        x = self.shared(self.shared(self.ln(x)))
        return F.linear(x, self.emb.weight)  # (B, T, 11): the embedding's table again


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 11, (3, 5), generator=g) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_i_then_w_equals_one_backward_over_microbatches(dtype):
    plain, split = Mixed().to(dtype), Mixed().to(dtype)
    parts = SplitBackward()
    for mb, idx in enumerate(_batches(3)):
        plain(idx).float().square().mean().backward()
        with parts.recording(mb):
            loss = split(idx).float().square().mean()
        with parts.backward(mb, split=True):
            loss.backward()
        assert parts.pending(mb)
    for mb in range(3):  # every I first, then the W's in the same order
        parts.run(mb)
        assert not parts.pending(mb)
    for (name, p), q in zip(plain.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_w_holds_only_the_linear_weights_used_once():
    model, parts = Mixed(), SplitBackward()
    deferred = [model.a.weight, model.b.weight, model.c.weight, model.d.weight, model.e.weight]
    with parts.recording(0):
        loss = model(_batches(1)[0]).square().mean()
    with parts.backward(0, split=True):
        loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == any(p is d for d in deferred), name
    parts.run(0)
    assert all(p.grad is not None for p in model.parameters())


def test_never_keeps_a_weight_in_i_and_unsplit_backward_defers_nothing():
    model = Mixed()
    parts = SplitBackward(never={id(model.a.weight)})
    with parts.recording(0):
        loss = model(_batches(1)[0]).square().mean()
    with parts.backward(0, split=True):
        loss.backward()
    assert model.a.weight.grad is not None and model.b.weight.grad is None
    parts.run(0)
    with parts.recording(1):
        loss = model(_batches(1)[0]).square().mean()
    with parts.backward(1, split=False):
        loss.backward()
    assert not parts.pending(1)


def test_w_fires_accumulate_grad_hooks_with_the_gradient():
    model, parts = Mixed(), SplitBackward()
    fired = []
    hook = lambda p: fired.append(None if p.grad is None else p.grad.clone())  # noqa: E731
    model.a.weight.register_post_accumulate_grad_hook(hook)
    with parts.recording(0):
        loss = model(_batches(1)[0]).square().mean()
    with parts.backward(0, split=True):
        loss.backward()
    assert all(g is None for g in fired)  # I adds nothing to the weight (autograd may call)
    parts.run(0)
    assert fired[-1] is not None and torch.equal(fired[-1], model.a.weight.grad)


def test_without_grad_nothing_is_recorded():
    model, parts = Mixed(), SplitBackward()
    with parts.recording(0), torch.no_grad():
        model(_batches(1)[0])
    with parts.backward(0, split=True):
        pass
    assert not parts.pending(0)


@pytest.mark.parametrize("width", [8, 12])  # square weights were silently wrong, others raised
def test_a_non_reentrant_checkpoint_region_stays_in_i(width):
    """torch.utils.checkpoint(use_reentrant=False) recomputes its region in backward with
    plain F.linear: the forward must save what that recompute saves, so its linears are not
    split (their dW is computed in I), and the gradients are one backward's."""
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    a, b, out = nn.Linear(8, width), nn.Linear(width, 8), nn.Linear(8, 3)

    def forward(x):
        return out(x + cp.checkpoint(lambda h: b(torch.relu(a(h))), x, use_reentrant=False))

    x = torch.randn(4, 8)
    forward(x).square().sum().backward()
    want = [p.grad.clone() for p in (a.weight, b.weight, out.weight)]
    for p in (a.weight, b.weight, out.weight, a.bias, b.bias, out.bias):
        p.grad = None
    split = SplitBackward()
    with split.recording(0):
        y = forward(x)
    with split.backward(0, split=True):
        y.square().sum().backward()
    split.run(0)
    for got, expected in zip((a.weight.grad, b.weight.grad, out.weight.grad), want, strict=True):
        assert torch.equal(got, expected)


def test_a_weight_with_a_gradient_hook_of_its_own_stays_in_i():
    """`weight.register_hook(fn)`: torch calls fn with the weight's gradient, never None;
    deferred, the I half called it with None (a hook that clamps crashed the step)."""
    plain, split = Mixed(), Mixed()
    seen = []
    for model in (plain, split):
        model.a.weight.register_hook(lambda g: (seen.append(g is None), g.clamp(-0.01, 0.01))[1])
    parts = SplitBackward()
    idx = _batches(1)[0]
    plain(idx).square().mean().backward()
    with parts.recording(0):
        loss = split(idx).square().mean()
    with parts.backward(0, split=True):
        loss.backward()
    assert split.a.weight.grad is not None and split.b.weight.grad is None  # b still waits
    parts.run(0)
    assert seen == [False, False]
    for (name, p), q in zip(plain.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
