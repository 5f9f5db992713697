"""A batch cut into microbatches: along dim 0, or taken as given when it is a list.

split_batch(x, 4, "inputs")            # a (32, ...) tensor -> 4 tensors of (8, ...)
split_batch((x, mask), 4, "inputs")    # a tuple -> 4 tuples, split alike
split_batch([x0, x1, x2, x3], 4, ...)  # per-microbatch entries, shapes may differ
"""

from __future__ import annotations

from typing import Any

import torch

from myelin.errors import ConfigError

__all__ = ["split_batch"]


def split_batch(batch: Any, microbatches: int, what: str) -> list[Any] | None:
    """Split a batch along dim 0 into microbatches; a list is taken as microbatches already."""
    if batch is None:
        return None
    if isinstance(batch, list):
        if len(batch) != microbatches:
            raise ConfigError(
                f"{what}: a list is taken as one entry per microbatch, got {len(batch)} entries "
                f"for microbatches={microbatches}"
            )
        return batch
    tensors = batch if isinstance(batch, tuple) else (batch,)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"{what}[{i}] is a {type(t).__name__}; pass tensors, a tuple of tensors, or a "
                f"list of per-microbatch entries"
            )
        if t.dim() == 0:
            raise ConfigError(f"{what}[{i}] is 0-d; a batch needs a leading batch dimension")
    size = tensors[0].shape[0]
    for i, t in enumerate(tensors):
        if t.shape[0] != size:
            raise ConfigError(f"{what}[{i}] has batch size {t.shape[0]}, but {what}[0] has {size}")
    if size == 0 or size % microbatches:
        raise ConfigError(
            f"{what}: a batch of {size} does not split into microbatches={microbatches}; "
            f"use a batch size divisible by {microbatches}, or pass a list of {microbatches} "
            f"microbatches"
        )
    chunks = [t.split(size // microbatches) for t in tensors]
    if isinstance(batch, tuple):
        return [tuple(c[i] for c in chunks) for i in range(microbatches)]
    return list(chunks[0])
