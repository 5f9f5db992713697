"""A batch cut into microbatches: along dim 0, or taken as given when it is a list.

split_batch(x, 4, "inputs")            # a (32, ...) tensor -> 4 tensors of (8, ...)
split_batch((x, mask), 4, "inputs")    # a tuple -> 4 tuples, split alike
split_batch([x0, x1, x2, x3], 4, ...)  # per-microbatch entries, shapes may differ
"""

from __future__ import annotations

from typing import Any

import torch

from myelin.errors import ConfigError

__all__ = ["split_batch", "uneven_rows"]


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
    if not tensors:
        raise ConfigError(f"{what} is an empty tuple; pass a tensor or a tuple of tensors")
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
    if size < microbatches:
        raise ConfigError(
            f"{what}: a batch of {size} rows cannot be split into microbatches={microbatches} "
            f"(each needs a row); with a DataLoader whose last batch is short, pass "
            f"drop_last=True, or pass a list of {microbatches} microbatches"
        )
    chunks = [t.tensor_split(microbatches) for t in tensors]  # sizes differ by one at most
    if isinstance(batch, tuple):
        return [tuple(c[i] for c in chunks) for i in range(microbatches)]
    return list(chunks[0])


def uneven_rows(batch: Any, microbatches: int) -> list[int] | None:
    """The row count of each microbatch when `split_batch` cuts `batch` unevenly (a short
    last batch), so each microbatch's loss counts by its rows; None when it splits evenly
    or is a list of microbatches already (each counts alike)."""
    if batch is None or isinstance(batch, list):
        return None
    first = batch[0] if isinstance(batch, tuple) else batch
    size = first.shape[0]
    if size % microbatches == 0:
        return None
    return [
        size // microbatches + (1 if i < size % microbatches else 0) for i in range(microbatches)
    ]
