"""Layers that take a fixed time, so a profile's figures do not depend on the machine.

    model = fixed_time_model(layers=4, forward_s=0.01, backward_s=0.02)

Each layer sleeps `forward_s` in forward and `backward_s` in backward (a custom autograd
Function), and multiplies by one scalar weight so the optimizer has something to step.
A sleep needs no core, so a pipeline of such stages has the ideal bubble of its
schedule however many processes share the machine: it calibrates the profiler.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from myelin.errors import ConfigError

__all__ = ["FixedTime", "fixed_time_model"]


class _Sleep(torch.autograd.Function):
    """y = x * w, sleeping a fixed time in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fwd_s: float, bwd_s: float):
        time.sleep(fwd_s)
        ctx.save_for_backward(x, w)
        ctx.bwd_s = bwd_s
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class FixedTime(nn.Module):
    """A layer whose forward takes `forward_s` and backward `backward_s` seconds."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        for name, value in (("forward_s", forward_s), ("backward_s", backward_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a number of seconds >= 0")
        self.forward_s = float(forward_s)
        self.backward_s = float(backward_s)
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            time.sleep(self.forward_s)
            return x * self.weight
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)

    def extra_repr(self) -> str:
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}"


def fixed_time_model(layers: int, forward_s: float, backward_s: float) -> nn.Sequential:
    """`layers` FixedTime layers in a row; split evenly, every stage takes the same time."""
    if type(layers) is not int or layers < 1:
        raise ConfigError(f"layers={layers!r} must be an int >= 1")
    return nn.Sequential(*(FixedTime(forward_s, backward_s) for _ in range(layers)))
