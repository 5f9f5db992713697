"""DASO's tensor and group helpers: the stale merge, Heat's chunking, the node groups."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["chunks", "make_groups", "merge_stale"]


def merge_stale(params: list[torch.Tensor], total: torch.Tensor, wait: int, nodes: int) -> None:
    """x <- (w x + total) / (w + N), w = 2 wait (1 when wait = 0): the newer local copy
    weighted against the sum of the N stale copies, computed as Heat does
    (x * w / (w + N) + total / (w + N))."""
    numer = wait * 2.0 if wait > 0 else 1.0
    denom = float(nodes) + numer
    update = total.float() / denom
    with torch.no_grad():
        offset = 0
        for p in params:
            n = p.numel()
            p.mul_(numer / denom).add_(update[offset : offset + n].view_as(p).to(p.dtype))
            offset += n


def make_groups(world: Any, g: int) -> tuple[Any, list[Any]]:
    """Every stage's node-local groups and G global groups (ranks of one local index), made
    by every rank in the same order; this rank's local group and its stage's global ones.
    A group of one rank is None (nothing to exchange)."""
    layout = world.layout
    local_mine, global_mine = None, [None] * g
    for stage in range(layout.stages):
        ranks = layout.replica_ranks(stage)
        nodes = [ranks[n * g : (n + 1) * g] for n in range(len(ranks) // g)]
        sets = [("local", n, r) for n, r in enumerate(nodes)]
        sets += [("global", i, ranks[i::g]) for i in range(g)]
        for kind, index, members in sets:
            if len(members) < 2:
                continue
            group = dist.new_group(members)
            world.extra_groups.append(group)
            if world.rank in members:
                if kind == "local":
                    local_mine = group
                else:
                    global_mine[index] = group
    return local_mine, global_mine


def chunks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Heat's split: the remainder first, then full chunks of `size` elements."""
    n = flat.numel()
    if n <= size:
        return [flat]
    count = math.ceil(n / size)
    sizes = [n - size * (count - 1)] + [size] * (count - 1)
    return list(torch.split(flat, sizes))
