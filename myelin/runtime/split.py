"""Backward in two parts: input gradients now (I), linear layers' weight gradients later (W).

Zero-bubble pipelining (Qi et al. 2023) sends a microbatch's input gradient upstream as
soon as it is known and computes the weight gradients later, in time the stage would
otherwise spend waiting. Here the split is made for linear layers, where most of a
transformer's weight-gradient work is: while a stage's forward runs, `F.linear` calls go
through `_Linear`, whose backward returns the input and bias gradients at once and, when
the microbatch's backward is split, keeps (input, output gradient) so that `run(mb)` can
compute dW = grad_out^T @ input later, flattened to 2-D as ATen's linear backward does, so
the result is bit for bit the unsplit one. Everything else (embeddings, norms, a weight
used twice or by anything but one linear) gets its gradients in I as usual.

W accumulates through `torch.autograd.backward` on the parameters, so AccumulateGrad's
hooks (bf16 carriers, gradient streaming, all-reduce overlap) fire as in one backward (in
I too, autograd may call a deferred weight's post-accumulate hooks with its gradient
unchanged; myelin's hooks ignore that: they act only when armed, for a whole backward).
Order of events per microbatch: `recording(mb)` around its forward; `backward(mb, split)`
around its I; `run(mb)` for its W, in the order the I's ran.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["SplitBackward"]


@dataclass(slots=True)
class _Microbatch:
    """What one microbatch's forward saw, and the weight gradients its I left for W."""

    uses: Counter = field(default_factory=Counter)  # id(parameter) -> linear uses
    shared: set[int] = field(default_factory=set)  # parameters used by anything else
    split: bool = False  # set while its backward runs: leave dW for W
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class SplitBackward:
    """Per-microbatch records of one stage's linear layers, and their deferred dW."""

    def __init__(self, never: set[int] | None = None) -> None:
        self.never = set(never or ())  # id() of parameters never deferred (tied ones)
        self._mbs: dict[int, _Microbatch] = {}

    @contextlib.contextmanager
    def recording(self, mb: int) -> Iterator[None]:
        """Route the forward of `mb`'s linear layers through `_Linear`."""
        record = self._mbs[mb] = _Microbatch()
        with _Mode(record, self.never):
            yield

    @contextlib.contextmanager
    def backward(self, mb: int, split: bool) -> Iterator[None]:
        """Around `mb`'s backward: with `split`, its linears' dW waits for `run(mb)`."""
        record = self._mbs.get(mb)
        if record is None:
            yield
            return
        record.split = split
        try:
            yield
        finally:
            record.split = False
            if not record.pending:  # nothing left for W
                del self._mbs[mb]

    def pending(self, mb: int) -> bool:
        """Whether `mb` has weight gradients waiting for `run`."""
        record = self._mbs.get(mb)
        return record is not None and bool(record.pending)

    def run(self, mb: int) -> None:
        """Compute and accumulate `mb`'s deferred weight gradients (its W)."""
        record = self._mbs.pop(mb, None)
        if record is None or not record.pending:
            return
        params, grads = [], []
        for weight, x, g in record.pending:
            # dW of out = x @ W^T over every row: (out, N) @ (N, in), as ATen computes it
            params.append(weight)
            grads.append(g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])))
        record.pending.clear()
        torch.autograd.backward(params, grads)

    def clear(self) -> None:
        """Forget every microbatch (after a failed step)."""
        self._mbs.clear()


class _Mode(TorchFunctionMode):
    """While a forward runs: F.linear with a trainable leaf weight becomes `_Linear`; any
    other differentiable use of a parameter marks it as computed in I."""

    def __init__(self, record: _Microbatch, never: set[int]) -> None:
        super().__init__()
        self.record = record
        self.never = never

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled() and not _in_checkpoint():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _deferrable(x, weight, self.never):
                self.record.uses[id(weight)] += 1
                return _Linear.apply(x, weight, bias, self.record)
        out = func(*args, **kwargs)
        if _differentiable(out):  # not a look at storage or shape (saved-tensor hooks do)
            for a in _flat(args, kwargs):
                if isinstance(a, torch.nn.Parameter):
                    self.record.shared.add(id(a))
        return out


def _in_checkpoint() -> bool:
    """Inside a non-reentrant `torch.utils.checkpoint` region: its recompute in backward
    runs plain F.linear, whose saved tensors must match the forward's, so it stays plain
    here too (its weights get their gradients in I)."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):  # (a torch without it: route as before)
        return False
    return top is not None and "_checkpoint_hook" in getattr(top[0], "__qualname__", "")


def _flat(args: Any, kwargs: dict) -> Iterator[Any]:
    """The arguments of a call, one level into lists and tuples (torch.cat's tensors)."""
    for a in (*args, *kwargs.values()):
        yield from a if isinstance(a, (list, tuple)) else (a,)


def _differentiable(out: Any) -> bool:
    """Whether a call's result (a tensor, or a tuple of them) is part of autograd's graph."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in outs)


def _deferrable(x: Any, weight: Any, never: set[int]) -> bool:
    """A linear whose dW can wait: a 2-D trainable leaf weight without gradient hooks of
    its own (`weight.register_hook(fn)` would be called with the I half's None, where torch
    never passes one), an input of 2 or more dimensions, no autocast (its casts would
    change what the backward computes)."""
    return (
        isinstance(x, torch.Tensor)
        and x.dim() >= 2
        and not torch.is_autocast_enabled(x.device.type)
        and isinstance(weight, torch.Tensor)
        and weight.requires_grad
        and weight.grad_fn is None
        and weight.dim() == 2
        and not weight._backward_hooks
        and id(weight) not in never
    )


class _Linear(torch.autograd.Function):
    """F.linear whose weight gradient waits for W when its microbatch's backward is split."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, record: Any) -> Any:
        ctx.save_for_backward(x, weight)  # under saved-tensor hooks, not the same objects
        ctx.param, ctx.record = weight, record  # the leaf itself: W accumulates into it
        # ATen's linear is one addmm on x flattened to 2-D when x is 2-D or contiguous (with
        # a bias); else a matmul and a broadcast add. Each backward is copied exactly.
        ctx.flat = x.dim() == 2 or x.is_contiguous()
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        record = ctx.record
        g2 = grad.reshape(-1, grad.shape[-1])  # (B, T, out) -> (N, out)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if x.dim() == 2 and x.stride(0) == 1 and x.stride(1) == x.shape[0] != 1:
                dx = weight.t().mm(g2.t()).t()  # x column-major: so is its gradient (ATen)
            else:
                dx = g2.mm(weight).view(x.shape)  # (N, out) @ (out, in) -> x's shape
        if ctx.needs_input_grad[2]:
            db = g2.sum(0) if ctx.flat else grad.sum(tuple(range(grad.dim() - 1)))
        if ctx.needs_input_grad[1]:
            key = id(ctx.param)
            if record.split and record.uses[key] == 1 and key not in record.shared:
                record.pending.append((ctx.param, x, grad))
            else:
                dw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        return dx, dw, db, None
