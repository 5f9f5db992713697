"""A stage's parameters as one flat fp32 vector: what DASO and EASGD average and swap.

They move the fp32 tensors the optimizer steps: the parameters themselves, or their
masters under half precision and optimizer offload, which the parameters then follow
(`publish`), so nothing a strategy does is lost to the next optimizer step's copy."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from myelin.errors import ConfigError

__all__ = ["flatten", "unflatten", "holding", "moved_weights"]


def moved_weights(
    ctx: Any, who: str
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], Callable[[], None]]:
    """(what strategy `who` moves, each parameter's by id, how the parameters follow) for
    a replicas.Context: the masters when the optimizer steps copies, else the parameters."""
    if ctx.moved is None:
        return list(ctx.params), {}, lambda: None
    moved = list(ctx.moved)
    for p, m in zip(ctx.params, moved, strict=True):
        if m.device != p.device:
            raise ConfigError(
                f"sync={who}(...): optimizer offload keeps the fp32 "
                f"master weights on {m.device}, apart from the parameters on {p.device}, "
                f"and the replicas' collectives run on the parameters' device; use "
                f"optimizer offload off (half precision is supported) or sync='allreduce'"
            )
    return moved, {id(p): m for p, m in zip(ctx.params, moved, strict=True)}, ctx.publish


def flatten(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The values of `params`, concatenated into a new fp32 vector (empty without any)."""
    if not params:
        return torch.zeros(0)
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def unflatten(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` into `targets`, in order."""
    offset = 0
    with torch.no_grad():
        for t in targets:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


@contextlib.contextmanager
def holding(
    params: Sequence[torch.Tensor], values: torch.Tensor, publish: Callable[[], None]
) -> Iterator[torch.Tensor]:
    """While open, `params` hold `values` (flat); their own values (yielded, flat) come
    back after. `publish` after each change: the parameters follow moved masters."""
    own = flatten(params)
    unflatten(values, params)
    publish()
    try:
        yield own
    finally:
        unflatten(own, params)
        publish()
