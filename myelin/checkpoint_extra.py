"""What `save(extra=...)` may hold: what a resume can read back.

Shards are loaded with `torch.load(weights_only=True)`, which refuses any object but
plain Python values, tensors and their containers; one numpy scalar in `extra` would
make the whole shard, its weights too, unreadable, so it is refused at the save.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from myelin.errors import ConfigError

__all__ = ["check_extra"]


def check_extra(extra: Any) -> None:
    """Raise a ConfigError naming the first value of `extra` that a resume could not read
    (shards are loaded with torch.load(weights_only=True): a numpy scalar, a Path, a
    datetime would make the whole shard, weights too, unreadable)."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise ConfigError(f"save(extra=...) must be a dict, got {type(extra).__name__}")
    bad = _unreadable(extra, "extra")
    if bad is not None:
        where, kind = bad
        raise ConfigError(
            f"save(extra=...): {where} is a {kind}, which torch.load(weights_only=True) "
            f"refuses, so the checkpoint could not be resumed; store plain Python values, "
            f"tensors and lists, tuples or dicts of them (int(x), x.tolist(), str(path))"
        )


def _unreadable(value: Any, where: str) -> tuple[str, str] | None:
    """(where, type) of the first part of `value` a weights-only load refuses, else None."""
    if _reads_back(value):
        return None
    parts = []
    if isinstance(value, dict):
        parts = [(f"{where}[{k!r}]", v) for k, v in value.items()]
        parts += [(f"{where} key {k!r}", k) for k in value]
    elif isinstance(value, list | tuple | set | frozenset):
        parts = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    for inner, part in parts:
        found = _unreadable(part, inner)
        if found is not None:
            return found
    kind = type(value)
    return where, f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")


def _reads_back(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 (whatever pickling or the weights-only check raises)
        return False
    return True
