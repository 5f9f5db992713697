"""The gradients the optimizer steps from: fp32, summed over microbatches in fp32.

In fp32 they are the parameters' own `.grad`. Under bf16/fp16 a parameter's gradient is
half precision, and summing 64 microbatches in it costs more accuracy than the half-
precision compute itself, so (as autocast users and Megatron do) each microbatch's
gradient is added into an fp32 sum as soon as backward finishes it, and the parameter's
`.grad` is cleared. The sum lives as the `.grad` of a *carrier*: an fp32 tensor of the
parameter's shape that owns no memory of its own (a broadcast zero), so code that works on
`.grad` of parameters (reducing over replicas, summing tied copies) works on carriers alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Gradients", "sparse_params"]


class Gradients:
    """The fp32 gradient of each of `params`: `holders[i].grad`."""

    def __init__(
        self, params: Sequence[nn.Parameter], half: bool, sparse: frozenset[int] = frozenset()
    ) -> None:
        self.params = list(params)
        self.half = half
        # parameters whose gradients are sparse (their ids): counted as what they hold
        self.sparse = [i for i, p in enumerate(self.params) if id(p) in sparse]
        size = 4 if half else None
        skip = set(self.sparse)
        self._dense_bytes = sum(
            p.numel() * (size or p.element_size())
            for i, p in enumerate(self.params)
            if i not in skip
        )
        self.handles: list[Any] = []  # the summing hooks (half precision only)
        if not half:
            self.holders: list[torch.Tensor] = self.params
            return
        self.holders = [_carrier(p) for p in self.params]
        self.handles = [
            p.register_post_accumulate_grad_hook(_summing_into(carrier))
            for p, carrier in zip(self.params, self.holders, strict=True)
        ]

    def close(self) -> None:
        """Take the summing hooks off the parameters (the trainer closed: they are the
        user's again, and a backward of theirs keeps its own .grad)."""
        for handle in self.handles:
            handle.remove()

    def grad(self, i: int) -> torch.Tensor | None:
        """Parameter `i`'s gradient so far, fp32 (None: none yet this step)."""
        return self.holders[i].grad

    def holders_of(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose `.grad` is the fp32 gradient of each of `params` that trains
        (a frozen one has none: a frozen weight tied across stages has nothing to sum)."""
        trained = [p for p in params if p.requires_grad]
        if not self.half:
            return trained
        index = {id(p): i for i, p in enumerate(self.params)}
        return [self.holders[index[id(p)]] for p in trained]

    def held_bytes(self) -> int:
        """Bytes the step's gradients take on the device: every dense one whole (it is,
        from the first backward on), a sparse one as the rows it holds so far."""
        total = self._dense_bytes
        for i in self.sparse:
            g = self.holders[i].grad
            if g is not None:
                total += _nbytes(g)
        return total

    def clear(self) -> None:
        for t in self.params:
            t.grad = None
        if self.half:
            for t in self.holders:
                t.grad = None


def _carrier(p: torch.Tensor) -> nn.Parameter:
    """An fp32 tensor shaped as `p`, on its device, whose data is one broadcast zero."""
    data = torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
    return nn.Parameter(data, requires_grad=False)


def _summing_into(carrier: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if carrier.grad is None:
            carrier.grad = g.float()  # a copy: p.grad is half precision
        else:
            carrier.grad.add_(g)
        p.grad = None

    return hook


def sparse_params(module: nn.Module) -> frozenset[int]:
    """ids of the parameters of `module` whose backward gives sparse gradients: those a
    module names in `sparse_gradients` (an LSHSoftmax's weight and bias), and the weight
    of an nn.Embedding or nn.EmbeddingBag with sparse=True."""
    found = set()
    for m in module.modules():
        names = getattr(type(m), "sparse_gradients", ())
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse:
            names = ("weight",)
        found.update(id(p) for n in names if isinstance(p := getattr(m, n, None), nn.Parameter))
    return frozenset(found)


def _nbytes(g: torch.Tensor) -> int:
    if g.is_sparse:  # indices and values, as accumulated (not coalesced)
        return g._indices().nbytes + g._values().nbytes
    return g.numel() * g.element_size()
