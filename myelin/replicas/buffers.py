"""A stage's buffers made equal over its replicas when the model is read.

Every strategy agrees on parameters; buffers (BatchNorm's running statistics) are each
replica's own, updated from its own batches, so with `data_parallel > 1` evaluation,
`state_dict()` and checkpoints would read a model that no replica holds. When the model
is read (`Trainer.model_view`, a collective), replica 0's buffers are broadcast to the
stage's other replicas, which keep them: DDP's `broadcast_buffers`, done when the model is
read instead of before every forward, since a training forward uses its batch's own
statistics. Replica 0's statistics are then those of its batches, as under DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from myelin.replicas.collectives import Collectives
from myelin.replicas.flat import unflatten
from myelin.runtime.group import World

__all__ = ["ReplicaBuffers"]


class ReplicaBuffers:
    """Broadcasts `module`'s buffers from replica 0 of this rank's stage to the others."""

    def __init__(self, module: torch.nn.Module, world: World) -> None:
        self.module = module
        self.world = world
        self.depth = 0  # open views: a nested one (evaluate's eval_steps) reads them as is
        self.broadcasts = 0  # times the buffers went out (or came in)
        self.comm: Collectives | None = None

    @contextlib.contextmanager
    def equal(self) -> Iterator[None]:
        """While open, every replica of the stage holds replica 0's buffers."""
        if self.depth == 0:
            self.equalise()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def equalise(self) -> None:
        """Broadcast the buffers from replica 0, one flat tensor per (dtype, device)."""
        world = self.world
        if world.dp_group is None:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.module.buffers():
            if b.dtype != torch.bool and b.numel():  # masks: constants, and gloo sums no bool
                groups.setdefault((b.dtype, b.device), []).append(b)
        if not groups:
            return
        if self.comm is None:  # the bounded waits exist once the peers are connected
            self.comm = Collectives(getattr(world, "waits", None))
        src = world.layout.rank_of(world.stage, 0)
        with torch.no_grad():
            for buffers in groups.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                self.comm.broadcast(flat, src, world.dp_group, "buffers")
                if world.replica != 0:
                    unflatten(flat, buffers)
        self.broadcasts += 1
