"""Learning-rate schedules that follow a run's progress, for `Trainer.fit(lr_schedule=...)`.

    trainer.fit(loader, steps=2000, max_seconds=600,
                lr_schedule=lambda opt: WarmupCosine(opt, warmup_steps=20, floor=0.1))

A scheduler with a `progress` attribute is told by `fit`, before each `step()`, the
share of the run done: the larger of the share of steps and the share of the time
budget, so a run that time cuts short still anneals.
"""

from __future__ import annotations

import math

import torch

__all__ = ["WarmupCosine"]


class WarmupCosine(torch.optim.lr_scheduler.LRScheduler):
    """Linear warmup over `warmup_steps`, under a cosine decay to `floor` x lr as progress
    goes 0 -> 1 (the lower of the two), so a run shorter than its warmup anneals too.

    The loop sets `progress` before each `step()`: the larger of the share of steps done
    and the share of the time budget used, so a run that time cuts short still anneals.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, floor: float) -> None:
        self.warmup_steps = warmup_steps
        self.floor = floor
        self.progress = 0.0
        super().__init__(optimizer)

    def resume_at(self, progress: float) -> None:
        """The next step's rate at the run's `progress` now, without stepping: the last
        step before a save set the rate of the run it had then (one resumed with more steps
        or time starts from the longer schedule's rate, not from the old end's floor)."""
        self.progress = progress
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        """Each group's rate for the step `last_epoch` at `progress`."""
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, self.progress)))
        factor = self.floor + (1 - self.floor) * cosine
        if self.last_epoch < self.warmup_steps:
            factor = min(factor, (self.last_epoch + 1) / self.warmup_steps)
        return [base * factor for base in self.base_lrs]
