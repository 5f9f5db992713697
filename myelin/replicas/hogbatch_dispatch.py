"""Who trains on which samples next: ranges of each epoch's permutation, exactly once.

Each epoch has its own seeded permutation of the dataset. A worker that asks for work gets
the next `batch` positions of it (a range), first from ranges given back by a lost worker,
then from the cursor. When the cursor reaches the end the next epoch begins at once (no
worker waits for the epoch's stragglers), but never two epochs ahead of an unfinished one.
An epoch is complete when every one of its ranges is done. Pure: no processes, no clock;
the runner (hogbatch_run.py) and the simulated clock (hogbatch_sim.py) drive it alike.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

__all__ = ["Dispatcher", "Range"]


class Range(NamedTuple):
    """Positions [start, start + count) of epoch `epoch`'s permutation."""

    epoch: int
    start: int
    count: int


class Dispatcher:
    """Hands out ranges of each epoch's permutation; takes them back from lost workers."""

    def __init__(self, samples: int, epochs: int, seed: int = 0, first_epoch: int = 0) -> None:
        if samples < 1 or epochs < 1:
            raise ValueError(f"need samples >= 1 and epochs >= 1 (got {samples}, {epochs})")
        self.samples, self.epochs, self.seed = samples, first_epoch + epochs, seed
        self.epoch, self.cursor = first_epoch, 0
        self.pending: deque[Range] = deque()  # given back by lost workers, handed out first
        self.outstanding: dict[int, list[Range]] = {}  # worker -> ranges it is working on
        self.left = {first_epoch: samples}  # epoch -> samples not yet done
        self.completed: list[int] = []  # epochs in the order they completed

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of the samples (the same for every caller)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.samples, generator=gen)

    def take(self, worker: int, batch: int) -> Range | None:
        """The next range for `worker` (at most `batch` samples); None: nothing to do now."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1 (got {batch})")
        if self.pending:
            r = self.pending.popleft()
            if r.count > batch:
                self.pending.appendleft(Range(r.epoch, r.start + batch, r.count - batch))
                r = Range(r.epoch, r.start, batch)
        else:
            if self.cursor >= self.samples:
                if self.epoch + 1 >= self.epochs or self.epoch - 1 in self.left:
                    return None  # all handed out, or the epoch before is not complete yet
                self.epoch, self.cursor = self.epoch + 1, 0
                self.left[self.epoch] = self.samples
            count = min(batch, self.samples - self.cursor)
            r = Range(self.epoch, self.cursor, count)
            self.cursor += count
        self.outstanding.setdefault(worker, []).append(r)
        return r

    def done(self, worker: int, r: Range) -> bool:
        """`worker` finished `r`; True when that completed its epoch."""
        self.outstanding[worker].remove(r)
        self.left[r.epoch] -= r.count
        if self.left[r.epoch] == 0:
            del self.left[r.epoch]
            self.completed.append(r.epoch)
            return True
        return False

    def lose(self, worker: int) -> list[Range]:
        """`worker` is gone: its unfinished ranges go back to be handed out first."""
        ranges = self.outstanding.pop(worker, [])
        self.pending.extend(ranges)
        return ranges

    def first_unfinished(self, first: int) -> int:
        """The epoch a resumed run starts from: the lowest one still under way (a later
        epoch can complete before an earlier one's last range comes back), else the one
        after the last completed, else `first`."""
        if self.left:
            return min(self.left)
        return max(self.completed) + 1 if self.completed else first

    def all_done(self) -> bool:
        """Every range of every epoch is done."""
        return not self.left and self.cursor >= self.samples and self.epoch + 1 >= self.epochs
