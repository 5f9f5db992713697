"""Room in the host pool for optimizer state before the step that creates it.

torch optimizers create their state (Adam's moments) lazily, inside `step()`. Offloaded,
that state is moved into the host pool bucket by bucket, after each bucket's update: a
pool too small for it used to fail after some buckets had stepped, leaving the model
half-updated. `StateHomes.reserve` allocates every new state tensor's home in the pool
before the first bucket is stepped, so a full pool raises HostMemoryError having changed
nothing; the step then copies the state into those homes (`take`).

The shapes and dtypes of the state a parameter will get are learnt exactly by stepping
the optimizer once on a scratch copy of one parameter per (param group, shape, dtype) and
throwing the result away; the layout is remembered, so this runs once per kind of
parameter, on the first step.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from myelin.errors import HostMemoryError
from myelin.offload.pool import HostPool, human_bytes
from myelin.offload.streaming import is_paged

__all__ = ["StateHomes"]

Layout = dict[str, tuple[torch.Size, torch.dtype]]


class StateHomes:
    """Pool tensors set aside for the optimizer state the coming step creates."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self._homes: dict[tuple[int, str], torch.Tensor] = {}  # (master, key) -> home
        self._layouts: dict[tuple[Any, ...], Layout] = {}  # kind of parameter -> its state
        # masters whose state exists or whose kind makes none: not looked at again, so a
        # step after the first walks no state (200 parameters: 0.4 ms a step otherwise)
        self._settled: set[int] = set()

    def reserve(
        self,
        optimizer: torch.optim.Optimizer,
        masters: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        device: torch.device,
    ) -> None:
        """Allocate homes for the state `optimizer.step()` will create for the masters that
        have a gradient but no state yet (`device`: where the update runs). Raises
        HostMemoryError, having allocated nothing, when they do not all fit."""
        new = []
        for i, g in enumerate(grads):
            if g is None or i in self._settled:
                continue
            if _has_state(optimizer, i, masters):
                self._settled.add(i)  # its state exists: no later step creates it
            else:
                new.append(i)
        if not new:
            return
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        needed: dict[tuple[int, str], tuple[torch.Size, torch.dtype]] = {}
        for i in new:
            g = grads[i]
            assert g is not None
            kind = (group_of.get(id(masters[i])), masters[i].shape, masters[i].dtype, g.is_sparse)
            if kind not in self._layouts:
                self._layouts[kind] = _probe(optimizer, masters, i, g, device)
            if not self._layouts[kind]:
                self._settled.add(i)  # its kind keeps no state (plain SGD)
            for key, layout in self._layouts[kind].items():
                needed[(i, key)] = layout
        self._allocate(needed)

    def forget(self) -> None:
        """The optimizer's state was replaced (a checkpoint loaded): look at it afresh."""
        self._settled.clear()

    def take(self, i: int, key: str, t: torch.Tensor) -> torch.Tensor:
        """`t` (state `key` of master `i`) copied to its home in the pool: the reserved one,
        or a new one when none was reserved (state made outside a step, or loaded)."""
        home = self._homes.pop((i, key), None)
        if home is not None and (home.shape != t.shape or home.dtype != t.dtype):
            self.pool.free(home)
            home = None
        if home is None:
            home = self.pool.empty(t.shape, t.dtype, what="optimizer state", lasting=True)
        home.copy_(t)
        return home

    def release(self) -> None:
        """Give back homes the step did not fill (a parameter the optimizer skipped)."""
        for home in self._homes.values():
            self.pool.free(home)
        self._homes.clear()

    def _allocate(self, needed: dict[tuple[int, str], tuple[torch.Size, torch.dtype]]) -> None:
        """Allocate every home in `needed`, or none of them."""
        made: dict[tuple[int, str], torch.Tensor] = {}
        try:
            for where, (shape, dtype) in needed.items():
                made[where] = self.pool.empty(shape, dtype, what="optimizer state", lasting=True)
        except HostMemoryError as e:
            for home in made.values():
                self.pool.free(home)
            total = sum(shape.numel() * dtype.itemsize for shape, dtype in needed.values())
            raise HostMemoryError(
                f"the optimizer creates its state in this step and it does not fit in the "
                f"host memory pool: it needs {human_bytes(total)} more. Nothing was changed "
                f"(weights, master weights and optimizer state are as before the step). {e}"
            ) from e
        self._homes.update(made)


def _has_state(optimizer: torch.optim.Optimizer, i: int, masters: list[torch.Tensor]) -> bool:
    """Whether master `i` has per-parameter state already (then the step makes none)."""
    return any(is_paged(t) for t in optimizer.state.get(masters[i], {}).values())


def _probe(
    optimizer: torch.optim.Optimizer,
    masters: list[torch.Tensor],
    i: int,
    grad: torch.Tensor,
    device: torch.device,
) -> Layout:
    """The shapes and dtypes of the state `optimizer` creates for master `i`: one step on a
    scratch copy of it (on `device`, a zero gradient), undone after, as are the gradients
    of every master and the param groups' settings (some optimizers count steps there)."""
    m = masters[i]
    data, saved_grads = m.data, [x.grad for x in masters]
    groups = [
        {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]
    try:
        for x in masters:
            x.grad = None
        m.data = data.to(device, copy=True)
        m.grad = grad.to(device, copy=True) if grad.is_sparse else torch.zeros_like(m.data)
        optimizer.step()
        return {k: (t.shape, t.dtype) for k, t in optimizer.state.get(m, {}).items() if is_paged(t)}
    finally:
        optimizer.state.pop(m, None)
        m.grad = None
        m.data = data
        for x, g in zip(masters, saved_grads, strict=True):
            x.grad = g
        for g, saved in zip(optimizer.param_groups, groups, strict=True):
            for key in set(g) - set(saved) - {"params"}:  # added by the probe's step
                del g[key]
            g.update(saved)
