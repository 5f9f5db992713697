"""What a stage's forward saved for backward: the record of one microbatch's saved
tensors in an ActivationStore, and the store's counters.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from myelin.offload.layers import Reach
from myelin.offload.pages import Page

__all__ = ["ActivationStats", "SavedMicrobatch"]


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
