"""A batch cut into microbatches: along dim 0, or taken as given when it is a list.

split_batch(x, 4, "inputs")            # a (32, ...) tensor -> 4 tensors of (8, ...)
split_batch((x, mask), 4, "inputs")    # a tuple -> 4 tuples, split alike
split_batch([x0, x1, x2, x3], 4, ...)  # per-microbatch entries, shapes may differ

A DataLoader collates a sample's tuple of inputs into a list: `collated` takes such a list,
beside a tensor of targets, as the tuple it was; `target_sizes` cuts targets flattened over
tokens (k rows per input row) at the inputs' boundaries when the batch splits unevenly.
"""

from __future__ import annotations

from typing import Any

import torch

from myelin.errors import ConfigError

__all__ = ["collated", "split_batch", "split_step", "target_sizes", "uneven_rows"]


def collated(inputs: Any, targets: Any) -> tuple[Any, Any]:
    """(inputs, targets), a list of equal-row tensors beside a tensor (or tuple) read as the
    tuple a DataLoader's `default_collate` made of it, not as per-microbatch entries (those
    come as lists on both sides)."""

    def batch_like(value: Any) -> bool:
        return isinstance(value, torch.Tensor) or (
            isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value)
        )

    def as_tuple(value: Any) -> Any:
        if (
            isinstance(value, list)
            and value
            and all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in value)
            and len({v.shape[0] for v in value}) == 1
        ):
            return tuple(value)
        return value

    if isinstance(inputs, list) and batch_like(targets):
        return as_tuple(inputs), targets
    if isinstance(targets, list) and batch_like(inputs):
        return inputs, as_tuple(targets)
    return inputs, targets


def _parts(batch: Any) -> tuple[list[Any], list[str]]:
    """The entries of a tuple (a namedtuple too) or dict batch, or the batch alone, with
    the names errors give them ("[0]", "['mask']")."""
    if isinstance(batch, dict):
        return list(batch.values()), [f"[{k!r}]" for k in batch]
    entries = list(batch) if isinstance(batch, tuple) else [batch]
    return entries, [f"[{i}]" for i in range(len(entries))]


def _rebuilt(batch: Any, entries: list[Any]) -> Any:
    """`entries` in the structure of `batch` (a tuple, namedtuple or dict), or alone."""
    if isinstance(batch, dict):
        return dict(zip(batch, entries, strict=True))
    if isinstance(batch, tuple):
        return type(batch)(*entries) if hasattr(batch, "_fields") else tuple(entries)
    return entries[0]


def _rows(batch: Any) -> int | None:
    """The row count of a tensor, tuple or dict batch (None for a list, None or an empty
    tuple)."""
    if isinstance(batch, list) or batch is None:
        return None
    entries = _parts(batch)[0]
    first = entries[0] if entries else None
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() > 0 else None


def target_sizes(inputs: Any, targets: Any, microbatches: int) -> list[int] | None:
    """Where to cut `targets` when they hold k rows per input row (flattened over tokens)
    and the batch splits unevenly: at the inputs' boundaries times k, so each microbatch
    pairs its rows of each (cut alone, their boundaries differ). None when a plain cut
    pairs them. Other unequal row counts of an uneven batch are a ConfigError."""
    n, t = _rows(inputs), _rows(targets)
    if n is None or t is None or n == t or n < microbatches or n % microbatches == 0:
        return None
    if t % n:
        raise ConfigError(
            f"targets have {t} rows and inputs {n}: split into microbatches={microbatches} "
            f"unevenly, they cannot be paired (targets need the inputs' rows, or a whole "
            f"number of rows per input row, as targets flattened over tokens have)"
        )
    k = t // n
    return [r * k for r in uneven_rows(inputs, microbatches)]


def split_step(inputs: Any, targets: Any, microbatches: int) -> tuple[Any, Any, Any]:
    """A step's (inputs, targets) as microbatches, and each one's rows (None: alike)."""
    inputs, targets = collated(inputs, targets)
    sizes = target_sizes(inputs, targets, microbatches)
    mb_inputs = split_batch(inputs, microbatches, "inputs")
    mb_targets = split_batch(targets, microbatches, "targets", sizes, mappings=True)
    rows = uneven_rows(targets if targets is not None else inputs, microbatches, sizes)
    return mb_inputs, mb_targets, rows


def split_batch(
    batch: Any,
    microbatches: int,
    what: str,
    sizes: list[int] | None = None,
    *,
    mappings: bool = False,
) -> list[Any] | None:
    """Split a batch along dim 0 into microbatches (of `sizes` rows, when given), each a
    tensor, tuple (namedtuple) or, with `mappings` (targets), dict as the batch was; a
    list is taken as microbatches already."""
    if batch is None:
        return None
    if isinstance(batch, list):
        if len(batch) != microbatches:
            raise ConfigError(
                f"{what}: a list is taken as one entry per microbatch, got {len(batch)} entries "
                f"for microbatches={microbatches}"
            )
        return batch
    if isinstance(batch, dict) and not mappings:
        raise ConfigError(
            f"{what} is a dict; pass a tensor or a tuple of tensors in the order the first "
            f"layer's forward takes them"
        )
    tensors, names = _parts(batch)
    if not tensors:
        raise ConfigError(
            f"{what} is an empty {type(batch).__name__}; pass a tensor or a tuple of tensors"
        )
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"{what}{name} is a {type(t).__name__}; pass tensors, a tuple of tensors, or a "
                f"list of per-microbatch entries"
            )
        if t.dim() == 0:
            raise ConfigError(f"{what}{name} is 0-d; a batch needs a leading batch dimension")
    size = tensors[0].shape[0]
    for name, t in zip(names, tensors, strict=True):
        if t.shape[0] != size:
            raise ConfigError(
                f"{what}{name} has batch size {t.shape[0]}, but {what}{names[0]} has {size}"
            )
    if size < microbatches:
        raise ConfigError(
            f"{what}: a batch of {size} rows cannot be split into microbatches={microbatches} "
            f"(each needs a row); with a DataLoader whose last batch is short, pass "
            f"drop_last=True, or pass a list of {microbatches} microbatches"
        )
    if sizes is not None:
        chunks = [t.split(sizes) for t in tensors]
    else:
        chunks = [t.tensor_split(microbatches) for t in tensors]  # sizes differ by one at most
    return [_rebuilt(batch, [c[i] for c in chunks]) for i in range(microbatches)]


def uneven_rows(batch: Any, microbatches: int, sizes: list[int] | None = None) -> list[int] | None:
    """The row count of each microbatch when `split_batch` cuts `batch` unevenly (a short
    last batch), so each microbatch's loss counts by its rows (`sizes`, when it was cut at
    those); None when it splits evenly or is a list of microbatches already (each counts
    alike)."""
    if sizes is not None:
        return list(sizes)
    if batch is None or isinstance(batch, list):
        return None
    size = _rows(batch)
    if size is None or size % microbatches == 0:
        return None
    return [
        size // microbatches + (1 if i < size % microbatches else 0) for i in range(microbatches)
    ]
