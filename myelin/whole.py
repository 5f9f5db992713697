"""The whole model's state_dict, gathered on rank 0 from replica 0's stages.

    layout = state_layout(model, stage_modules)   # every rank, from the model it was given
    state = gather(trainer, layout)               # the whole state_dict on rank 0, else None

Every rank first meets the others in a bounded barrier (a lost or frozen peer is named
within seconds); then tensors travel by torch.distributed point-to-point, a transfer that a
peer's death breaks named as that loss. Nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from myelin import reshard
from myelin.runtime.group import World

__all__ = ["gather", "state_layout"]


def state_layout(model: Any, stage_modules: list[torch.nn.Module]) -> list[list[tuple]]:
    """Per stage, its state_dict entries as (local key, full-model keys, shape, dtype).

    Computed on every rank from the model it was given (eager or meta), so rank 0 can
    allocate what the other stages send without asking them.
    """
    full: dict[int, list[str]] = {}
    whole = model if isinstance(model, torch.nn.Module) else torch.nn.ModuleList(model)
    for key, t in whole.state_dict(keep_vars=True).items():  # (a list: keyed as a Sequential)
        full.setdefault(id(t), []).append(key)
    layout, seen = [], set()
    for module in stage_modules:
        entries = []
        for key, t in module.state_dict(keep_vars=True).items():
            names = [n for n in full.get(id(t), [key]) if n not in seen]
            seen.update(names)
            entries.append((key, names, tuple(t.shape), t.dtype))
        layout.append(entries)
    return layout


def gather(trainer: Any, layout: list[list[tuple]]) -> dict[str, torch.Tensor] | None:
    """The whole model's state_dict on rank 0 (None elsewhere) of a trainer (its world,
    module and updater, as checkpoint.Checkpointable), sent tensor by tensor from
    replica 0's stages with torch.distributed point-to-point; nothing is pickled. Each
    stage gives its true weights: the fp32 masters where they exist (half precision,
    optimizer offload), everything in the dtype the model had when it was given."""
    world = trainer.world
    if world.waits is not None and world.layout.world_size > 1:  # (bounded: a lost or
        world.waits.barrier("state_dict()")  # frozen peer is named) every rank is here now
    if world.replica != 0 and world.rank != 0:
        return None
    mine = reshard.export(trainer.module, trainer.updater)
    if world.rank != 0:
        for key, names, _, dtype in layout[world.stage]:
            if names:
                t = mine[key].detach().to("cpu", dtype).contiguous()
                _point_to_point(world, lambda t=t: dist.isend(t, dst=0))
        return None
    out: dict[str, torch.Tensor] = {}
    for stage, entries in enumerate(layout):
        src = world.layout.rank_of(stage, 0)
        for key, names, shape, dtype in entries:
            if not names:
                continue  # a tied parameter, already taken from the stage that holds it first
            if src == 0:
                t = mine[key].detach().to("cpu", dtype, copy=True)
            else:
                t = torch.empty(shape, dtype=dtype)
                _point_to_point(world, lambda t=t, src=src: dist.irecv(t, src=src))
            for name in names:
                out[name] = t
    return out


def _point_to_point(world: World, begin: Any) -> None:
    """One send or receive of state_dict's gather, between ranks that all passed its
    barrier; a peer lost during it is named (one that closed after the same steps, once
    its part is sent, is no loss: strict=False)."""
    if world.waits is None:
        begin().wait()
        return
    world.waits.point_to_point(begin, "state_dict()'s gather of the stages' weights")
