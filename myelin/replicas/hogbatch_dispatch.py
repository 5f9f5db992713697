"""Who trains on which samples next: ranges of each epoch's permutation, exactly once.

Each epoch has its own seeded permutation of the dataset. A worker that asks for work gets
the next `batch` positions of it (a range), first from ranges given back by a lost worker,
then from the cursor. When the cursor reaches the end the next epoch begins at once (no
worker waits for the epoch's stragglers), but never two epochs ahead of an unfinished one.
An epoch is complete when every one of its ranges is done. Pure: no processes, no clock;
the runner (hogbatch_run.py) and the simulated clock (hogbatch_sim.py) drive it alike.

`progress` says exactly which samples are in the weights (a checkpoint's): the frontier
(epoch, cursor), the ranges before it not done and the dataset's size; a Dispatcher built
from it hands out only those and what lies past the frontier, so a resumed run trains no
sample twice.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import torch

__all__ = ["Dispatcher", "Range", "progress_done"]


class Range(NamedTuple):
    """Positions [start, start + count) of epoch `epoch`'s permutation."""

    epoch: int
    start: int
    count: int


def progress_done(progress: dict[str, Any]) -> bool:
    """Whether `progress` (Dispatcher.progress) holds only complete epochs: the next epoch may
    start afresh on any data. False where it cannot tell (an older one, without `samples`)."""
    samples = progress.get("samples")
    return samples is not None and not progress["todo"] and progress["cursor"] >= samples


class Dispatcher:
    """Hands out ranges of each epoch's permutation; takes them back from lost workers."""

    def __init__(
        self,
        samples: int,
        epochs: int,
        seed: int = 0,
        first_epoch: int = 0,
        progress: dict[str, Any] | None = None,
    ) -> None:
        if samples < 1 or epochs < 1:
            raise ValueError(f"need samples >= 1 and epochs >= 1 (got {samples}, {epochs})")
        self.samples, self.epochs, self.seed = samples, first_epoch + epochs, seed
        self.epoch, self.cursor = first_epoch, 0
        self.pending: deque[Range] = deque()  # given back by lost workers, handed out first
        self.outstanding: dict[int, list[Range]] = {}  # worker -> ranges it is working on
        self.left = {first_epoch: samples}  # epoch -> samples not yet done
        self.completed: list[int] = []  # epochs in the order they completed
        self.beyond: dict[str, Any] | None = None  # progress past this run's last epoch
        if progress is not None:
            self._restore(progress)

    def _restore(self, progress: dict[str, Any]) -> None:
        """Start from a checkpoint's `progress`; what lies past this run's epochs (the
        next epoch begun before the checkpoint) is kept for `progress` to hand on."""
        epoch, cursor = int(progress["epoch"]), int(progress["cursor"])
        todo = [Range(*map(int, r)) for r in progress["todo"]]
        if epoch >= self.epochs:  # this run ends before the frontier's epoch
            self.beyond = {
                "epoch": epoch,
                "cursor": cursor,
                "todo": [list(r) for r in todo if r.epoch >= self.epochs],
            }
            todo = [r for r in todo if r.epoch < self.epochs]
            epoch, cursor = self.epochs - 1, self.samples
        self.epoch, self.cursor = epoch, cursor
        self.pending = deque(sorted(todo))
        self.left = {}
        for r in todo:
            self.left[r.epoch] = self.left.get(r.epoch, 0) + r.count
        if cursor < self.samples:
            self.left[epoch] = self.left.get(epoch, 0) + self.samples - cursor

    def progress(self, landed: dict[int, int] | None = None) -> dict[str, Any]:
        """Which samples are done, as plain data: the frontier (`epoch`, `cursor`: every
        range past it is to do) and `todo`, the ranges before it not done: handed back,
        handed out and not done, except each worker's first `landed[w]` outstanding ones
        (their updates are in the weights; a worker trains its ranges in order)."""
        landed = landed or {}
        todo = list(self.pending)
        for w, ranges in self.outstanding.items():
            todo += ranges[landed.get(w, 0) :]
        if self.beyond is None:
            return {"epoch": self.epoch, "cursor": self.cursor, "todo": [list(r) for r in todo],
                    "samples": self.samples}  # fmt: skip
        if self.cursor < self.samples:  # this run stopped short of its last epoch's end
            todo.append(Range(self.epoch, self.cursor, self.samples - self.cursor))
        return {**self.beyond, "todo": [list(r) for r in todo] + self.beyond["todo"],
                "samples": self.samples}  # fmt: skip

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
