"""What a stage's forward saved for backward: the record of one microbatch's saved
tensors, the store's counters, and the bytes saved remembered per input signature.

Accounting saved activations takes a saved-tensor hook pair, and autograd calls into
Python twice per saved tensor: on a small model about 6% of a CPU step. When nothing
pages out and no accounted limit must be checked tensor by tensor, the count is all
the hooks give, and for the same inputs (shapes, dtypes, devices, training mode) a
forward saves the same bytes. So a signature's forward is measured under the hooks
once, later ones reuse the count, and every `RECHECK`-th is measured again: a stage
whose saved bytes differ for one signature (control flow that follows the data) is
measured every time from then on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from myelin.offload.layers import Reach
from myelin.offload.pages import Page

__all__ = ["RECHECK", "ActivationStats", "SavedMicrobatch", "SavedTally", "signature"]

RECHECK = 32  # every this many forwards of a known signature, measure it again
_MAX_SIGNATURES = 256  # distinct input signatures remembered (varied lengths: one each)


@dataclass(slots=True)
class ActivationStats:
    """Counters over the life of a store (`*_step_*`: the last step only)."""

    offloaded_bytes: int = 0  # paged out since the start
    offloaded_step_bytes: int = 0
    fetched_step_bytes: int = 0  # brought back in the last step
    resident_step_bytes: int = 0  # would-be pages of the last step that never left
    pages: int = 0  # pages made (paged out) since the start
    layers: int = 0  # layers of the last microbatch saved
    prefetch_hits: int = 0  # pages already back when backward needed them
    prefetch_misses: int = 0  # pages backward had to wait for
    wait_s: float = 0.0  # time backward waited for pages


@dataclass(slots=True)
class SavedMicrobatch:
    """One microbatch's saved tensors in an ActivationStore: pages, accounting, progress."""

    pages: list[Page] = field(default_factory=list)  # by seq: the order of last saves
    kept: dict[int, int] = field(default_factory=dict)  # storage pointer -> bytes on device
    resident: int = 0  # bytes this microbatch holds on the device
    layer: int = 0  # the forward's current layer, then the last layer
    layer_bytes: list[int] = field(default_factory=lambda: [0])  # page bytes per layer
    window: int = 0  # Ahead.window at layer `window_at`: its earlier layers' bytes, so kept
    window_at: int = -1  # until one of their pages moves (-1: none; layer 0 grows as it goes)
    seq: int = 0
    originals: deque[Page] = field(default_factory=deque)  # the forward's storage, by seq
    held: int = 0  # bytes of `originals`
    position: int | None = None  # index of the page backward is at; None before backward
    cursor: int = 0  # pages[cursor:] were brought back (or never left)
    reach: Reach | None = None  # the window below each page, once the forward is done
    fetching: str = ""  # "bringing back activations of microbatch N", for errors


def signature(*values: Any) -> tuple | None:
    """A hashable description of `values` (tensors by shape, dtype, device and whether
    they require grad; containers recursed; plain scalars by value); None when a value
    is of a kind that is not described, so its forward is always measured."""
    out: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append((tuple(value.shape), value.dtype, value.device, value.requires_grad))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            inner = signature(*value)
            if inner is None:
                return None
            out.append(inner)
        elif isinstance(value, dict):
            inner = signature(*value.values())
            if inner is None:
                return None
            out.append((tuple(value), inner))
        else:
            return None
    return tuple(out)


class SavedTally:
    """Saved bytes per signature; `known` says when a forward may skip the hooks."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bytes: dict[tuple, list[int]] = {}  # signature -> [bytes, uses since measured]
        self.measured = 0  # forwards measured under the hooks
        self.reused = 0  # forwards that reused a count

    def known(self, sig: tuple | None) -> int | None:
        """The bytes a forward with `sig` saves, if it need not be measured now."""
        if not self.enabled or sig is None:
            return None
        entry = self._bytes.get(sig)
        if entry is None or entry[1] + 1 >= RECHECK:
            return None
        entry[1] += 1
        self.reused += 1
        return entry[0]

    def record(self, sig: tuple | None, nbytes: int) -> None:
        """A forward with `sig` was measured at `nbytes`; a count that differs from the
        one remembered turns reuse off for good."""
        self.measured += 1
        if not self.enabled or sig is None:
            return
        entry = self._bytes.get(sig)
        if entry is not None and entry[0] != nbytes:
            self.enabled = False
            self._bytes.clear()
            return
        if entry is None and len(self._bytes) >= _MAX_SIGNATURES:
            self._bytes.clear()
        self._bytes[sig] = [nbytes, 0]
