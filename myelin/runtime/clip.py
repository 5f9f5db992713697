"""Gradient clipping by the norm of the whole model's gradient, over every stage, replica and
offload bucket, computed as `torch.nn.utils.clip_grad_norm_` computes it in one process.

Each stage takes the norm of each of its gradients; the norms travel in one all-reduce, each
in the slot its parameter has in the whole model's parameter order (a tied parameter counted
once, on the first stage that holds it). Every rank then takes the norm of the norms in that
order, so the total, and the clipped gradients, are those of one process.

Two scopes, by what the replicas apply. Where every replica applies the replicas' mean
gradient (AllReduce), the all-reduce spans the world and replicas other than 0 add zeros,
their gradients being the same averages. Where each replica applies its own (EASGD; DASO,
whose gradients are averaged inside a node at most), each replica's norm is of its own
gradient: the all-reduce spans that replica's pipeline ranks only (`group`), and with one
stage (`alone`) there is none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GlobalNorm", "norm_slots"]

_ABSENT = -1.0  # the slot of a parameter without a gradient this step


def norm_slots(
    stage_modules: Sequence[nn.Module], stage: int, order: Sequence[torch.Tensor] = ()
) -> tuple[list[int], int]:
    """For each trainable parameter of `stage`, its position in the whole model's order of
    trainable parameters (-1 for a copy of a parameter an earlier stage holds), and the
    number of positions. `stage_modules` are every stage's modules, before placement;
    `order` is the model's own `parameters()` (its registration order, which may differ
    from its layers': clip_grad_norm_ sums in it), the layers' order where it is empty."""
    holder: dict[int, int] = {}  # id -> the position in layer order of its first holder
    mine: list[int | None] = []  # this stage's parameters' ids, None for a later copy
    for s, module in enumerate(stage_modules):
        for p in module.parameters():
            if not p.requires_grad:
                continue
            first = id(p) not in holder
            if first:
                holder[id(p)] = len(holder)
            if s == stage:
                mine.append(id(p) if first else None)
    in_model = {id(p): i for i, p in enumerate(order)}
    ranked = sorted(holder, key=lambda i: (i not in in_model, in_model.get(i, 0), holder[i]))
    slot = {pid: k for k, pid in enumerate(ranked)}
    return [-1 if pid is None else slot[pid] for pid in mine], len(holder)


class GlobalNorm:
    """Clips one stage's gradients by the global norm; every rank must call `clip` together."""

    def __init__(
        self,
        max_norm: float,
        slots: list[int],
        total_slots: int,
        *,
        counts: bool,
        device: torch.device,
        group: Any = None,
        alone: bool = False,
    ) -> None:
        # counts: this rank's norms go into the sum (replica 0); others add zeros
        # group: the ranks whose norms make the total (None: the world)
        # alone: this rank holds every gradient of the total (no collective)
        self.max_norm = float(max_norm)
        self.slots = slots
        self.total_slots = total_slots
        self.counts = counts
        self.device = device
        self.group = group
        self.alone = alone
        self.last_norm: float | None = None

    def clip(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Scale `grads` (this stage's, in parameter order, fp32) in place so that the whole
        model's gradient norm is at most max_norm; returns that norm before clipping."""
        present = [g for g in grads if g is not None]
        vector = torch.zeros(self.total_slots, dtype=torch.float32, device=self.device)
        if self.counts:
            dense = [g for g in present if not g.is_sparse]
            norms = iter(torch._foreach_norm(dense, 2.0) if dense else [])
            for slot, g in zip(self.slots, grads, strict=True):
                if g is None:
                    if slot >= 0:
                        vector[slot] = _ABSENT
                    continue
                # a sparse gradient (an LSH layer's rows): the norm of its summed rows
                norm = _sparse_norm(g) if g.is_sparse else next(norms)
                if slot >= 0:
                    vector[slot] = norm.to(self.device, torch.float32)
        if not self.alone and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(vector, group=self.group)
        # the norms of the gradients that exist, in the whole model's order, as one process
        # stacks them for clip_grad_norm_
        total = torch.linalg.vector_norm(vector[vector >= 0], 2.0)
        self.last_norm = float(total)
        if present:
            coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in present:
                if g.is_sparse:
                    g.mul_(coef.to(g.device))
                else:
                    by_device.setdefault(g.device, []).append(g)
            for device, tensors in by_device.items():
                torch._foreach_mul_(tensors, coef.to(device))
        return total


def _sparse_norm(g: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a sparse COO gradient (entries given twice are summed first)."""
    return torch.linalg.vector_norm(g.coalesce().values().float(), 2.0)
