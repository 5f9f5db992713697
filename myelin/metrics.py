"""The metrics rows of a training run, the same numbers on every rank.

    meter = Meter(trainer.timeline, replicas=1)
    meter.add(loss, tokens, seconds)          # after each trainer.step
    row = meter.row(step, lr, val_loss)       # every rank at once: a collective

A row covers the steps since the last one: `loss` (the last step's), `loss_avg`, both
the mean over replicas (under DASO and EASGD, whose `step()` returns each replica's own
loss, the row's all-reduce averages them; under AllReduce they are equal already), `lr`,
`tokens_per_s` (training tokens of every replica per second spent in `trainer.step`),
`idle_frac` (the share of wall time that the devices of all ranks together were not
computing forward, backward or the optimizer: bubbles, offload waits, collectives,
evaluation's sends, host overhead) and `val_loss` when validation ran. With the
timeline recording (profile=...), busy time comes from its spans, and on a CPU the
loop's own sends are not counted as compute; otherwise from its compute counter.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from myelin.profile.timeline import Timeline

__all__ = ["Meter", "all_reduce"]


class Meter:
    """Loss, throughput and idle share since the last row."""

    def __init__(
        self,
        timeline: Timeline,
        replicas: int,
        waits: Any = None,
        local_loss: bool = False,
        replica: int = 0,
    ) -> None:
        self.timeline = timeline
        self.waits = waits  # bounded waits for the all-reduce of each row (runtime/bounded.py)
        self.replicas, self.replica = replicas, replica  # how many, and this rank's
        # the steps' losses are each replica's own (DASO, EASGD): the row averages them
        self.local_loss = local_loss
        self._reset()

    def _reset(self) -> None:
        self.since = self.timeline.now()
        if self.timeline.enabled:  # by time: a bounded timeline folds old spans away
            self.busy_since = self.timeline.compute_s(self.since)
        else:
            self.busy_since = self.timeline.busy_s
        self.losses: list[float] = []
        self.tokens = 0
        self.step_seconds = 0.0

    def add(self, loss: float, tokens: int, seconds: float) -> None:
        """Count one training step: its loss, this replica's tokens, and how long it took."""
        self.losses.append(loss)
        self.tokens += tokens
        self.step_seconds += seconds

    def _busy_and_wall(self) -> tuple[float, float]:
        """This rank's compute seconds and wall seconds since the last row."""
        now = self.timeline.now()
        if not self.timeline.enabled:
            return self.timeline.busy_s - self.busy_since, max(now - self.since, 0.0)
        busy = self.timeline.compute_s(now) - self.busy_since
        return busy, max(now - self.since, 0.0)

    def row(self, step: int, lr: float | None, val_loss: float | None) -> dict[str, Any]:
        """The row for `step`, and a fresh window; every rank must call it (idle_frac is
        summed over ranks)."""
        n = len(self.losses)
        last, avg = self.losses[-1] if n else math.nan, sum(self.losses) / max(1, n)
        values = [*self._busy_and_wall(), self.step_seconds]
        values += [last, avg] if self.local_loss else []
        busy, wall, seconds, *losses = all_reduce(values, waits=self.waits)
        mine = [float(self.tokens if r == self.replica else 0) for r in range(self.replicas)]
        *counts, lr_seen = all_reduce([*mine, -1.0 if lr is None else lr], "max", self.waits)
        tokens = sum(counts)  # a replica's: its ranks' count
        lr = lr_seen if lr_seen >= 0 else None  # (a stage without parameters has none)
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        if losses:  # the ranks of a replica hold its loss: the sum over ranks / ranks
            last, avg = losses[0] / ranks, losses[1] / ranks
        row: dict[str, Any] = {"step": step, "loss": last, "loss_avg": avg}
        if lr is not None:
            row["lr"] = lr
        # every replica's tokens over the ranks' mean time in trainer.step: one number on
        # every rank, also where the replicas' batches differ
        row["tokens_per_s"] = tokens / max(seconds / ranks, 1e-9)
        row["idle_frac"] = max(0.0, 1 - busy / wall) if wall > 0 else 0.0
        if val_loss is not None:
            row["val_loss"] = val_loss
        self._reset()
        return row


def all_reduce(
    values: list[float],
    op: str = "sum",
    waits: Any = None,
    what: str = "fit's agreement of all ranks",
) -> list[float]:
    """Sum or max over every rank (a tiny gloo all-reduce, no pickling); as is when alone.
    With `waits` (runtime/bounded.py) a lost or departed rank raises instead of hanging."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    if waits is None:
        dist.all_reduce(t, op=reduce_op)
    else:
        waits.all_reduce(t, reduce_op, what=what)
    return t.tolist()
