"""A stage's parameters as one flat fp32 vector: what DASO and EASGD average and swap."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["flatten", "unflatten", "holding"]


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
def holding(params: Sequence[torch.Tensor], values: torch.Tensor) -> Iterator[torch.Tensor]:
    """While open, `params` hold `values` (flat); their own values (yielded, flat) come
    back after."""
    own = flatten(params)
    unflatten(values, params)
    try:
        yield own
    finally:
        unflatten(own, params)
