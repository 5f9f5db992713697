"""DASO's schedule, without communication: when to send, merge and average, and how the
global skip S, the local skip ls and the batches to wait B change from epoch to epoch.

It follows Heat's `DASO.step` and `DASO.epoch_loss_logic` (heat/optim/dp_optimizer.py;
see /work/shared/algorithms/daso_easgd.md, section 1). `advance()` is called after each
step's optimizer step and returns the events the step ends with, in order:

    Send(group, wait, blocking, id)   the sender group (one rank per node, the ranks of
                                      local index `group`) starts averaging its parameters
    Merge(group, id)                  that group merges send `id` (stale by `wait` steps)
                                      and broadcasts the result inside each node (id
                                      None: the broadcast only)
    Average(group, id)                that group waits for send `id`, takes the plain
                                      average and broadcasts it inside each node

`local_sync` says whether the next step averages gradients inside the node. At an
epoch's last step `advance()` also runs the plateau rule with the epoch's mean loss,
which `agree` (given by the caller: an all-reduce, once per epoch) makes every
replica's mean of the losses `advance()` was given on this rank.

Deliberate differences from Heat: with `warmup_epochs=0` cycling starts at epoch 0 (in
Heat it never starts: it tests `epoch == warmup_epochs` only after epoch 0 ended); each
send is merged exactly once, named by its id (Heat pops a FIFO, which with one rank per
node would merge the send it just started).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["Average", "DasoSchedule", "Merge", "Plateau", "Send"]


class Send(NamedTuple):
    group: int
    wait: int  # B' recorded at send time: the merge weights the newer local copy by 2B'
    blocking: bool  # warm-up/cool-down/epoch end: averaged before the step ends
    id: int


class Merge(NamedTuple):
    group: int
    id: int | None  # None: nothing left to merge, only the broadcast inside each node


class Average(NamedTuple):
    group: int
    id: int


@dataclass(slots=True)
class Plateau:
    """Heat's DetectMetricPlateau (mode min, relative threshold, patience 2, no cooldown):
    True on the third epoch in a row whose loss did not improve on the best by `threshold`."""

    threshold: float
    patience: int = 2
    best: float = float("inf")
    bad: int = 0

    def test(self, loss: float) -> bool:
        better = self.best * (1 - self.threshold if self.best >= 0 else 1 + self.threshold)
        if loss < better:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        if self.bad > self.patience:
            self.bad = 0
            return True
        return False


class DasoSchedule:
    """The per-step and per-epoch schedule of one DASO run, the same on every rank."""

    def __init__(
        self,
        *,
        node_size: int,
        epoch_steps: int,
        total_epochs: int | None,
        warmup_epochs: int,
        cooldown_epochs: int,
        max_global_skips: int,
        skip_reduction_factor: int,
        local_skip_factor: int,
        stability_level: float,
        agree: Callable[[float], float] | None = None,
    ) -> None:
        self.node_size = node_size
        self.agree = agree or (lambda loss: loss)  # a rank's epoch mean -> every replica's
        self.last_batch = epoch_steps - 1
        self.total_epochs = total_epochs
        self.warmup_epochs, self.cooldown_epochs = warmup_epochs, cooldown_epochs
        self.max_gs, self.srf, self.lsf = max_global_skips, skip_reduction_factor, local_skip_factor
        self.plateau = Plateau(stability_level)
        self.global_skip = self.local_skip = self.batches_to_wait = 0
        if warmup_epochs == 0 and not self._cooling(0):
            self.global_skip, self.local_skip, self.batches_to_wait = 4, 1, 1
        self.batch = self.epoch = 0
        self.send_mod, self.send_mod_m1 = 0, None
        self.local_sync = True
        self.pending: tuple[int, int] | None = None  # (group, id) of the unmerged send
        self.sends = 0
        self.epoch_loss, self.epoch_count = 0.0, 0

    @property
    def skips(self) -> tuple[int, int, int]:
        """(S, ls, B): the global skip, the local skip and the batches to wait."""
        return self.global_skip, self.local_skip, self.batches_to_wait

    def _cooling(self, epoch: int) -> bool:
        return self.total_epochs is not None and epoch >= self.total_epochs - self.cooldown_epochs

    def advance(self, loss: float = 0.0) -> list[Any]:
        """The events that end this step (its optimizer step done), as Heat's DASO.step."""
        self.epoch_loss += loss
        self.epoch_count += 1
        b, last, gs, ls = self.batch, self.last_batch, self.global_skip, self.local_skip
        nxt = b + 1
        gmod = b % gs if gs > 0 else 0
        lmod = b % ls if ls > 0 else 0
        btw = self.batches_to_wait if self.batches_to_wait + b <= last else last - b
        if b == last or gmod == 0:
            return self._global_sync(btw)
        self.batch += 1
        if nxt % gs == 0:
            self.local_sync = True
            return []
        events: list[Any] = []
        if gmod < btw:
            if nxt == last:
                self.local_sync = True
            return []
        if gmod == btw:
            events += self._merge(self.send_mod_m1)
            if ls > 1:
                self.local_sync = False
        if ls == 1 and nxt != last:
            self.local_sync = True
            return events
        if lmod == 0:
            self.local_sync = False
        elif nxt % ls == 0:
            self.local_sync = True
        if nxt == last:
            self.local_sync = True
        return events

    def _merge(self, group: int | None) -> list[Any]:
        """Merge the pending send of `group`; with none pending (merged already), only the
        node-local broadcast from that group's rank, as Heat's `_local_update`."""
        if group is None:
            return []
        if self.pending is None or self.pending[0] != group:
            return [Merge(group, None)]
        event = Merge(*self.pending)
        self.pending = None
        return [event]

    def _global_sync(self, btw: int) -> list[Any]:
        blocking = self.batch == self.last_batch or self.batches_to_wait == 0
        send = Send(self.send_mod, btw, self.global_skip < 1, self.sends)
        self.sends += 1
        events: list[Any] = [send]
        if self.batches_to_wait != 0:
            events += self._merge(self.send_mod_m1)
        if blocking:
            events.append(Average(send.group, send.id))
            self.send_mod_m1 = None
            if self.batch == self.last_batch:
                self.send_mod, self.batch = 0, 0
                self.epoch += 1
                self._epoch_end(self.agree(self.epoch_loss / max(self.epoch_count, 1)))
                self.epoch_loss, self.epoch_count = 0.0, 0
                return events
        else:
            self.pending = (send.group, send.id)
            self.send_mod_m1 = self.send_mod
        self.batch += 1
        self.send_mod = (self.send_mod + 1) % self.node_size
        return events

    def _epoch_end(self, loss: float) -> None:
        """Heat's epoch_loss_logic with the epoch's mean loss (over every replica)."""
        e = self.epoch
        if e < self.warmup_epochs:
            self.global_skip = self.local_skip = self.batches_to_wait = 0
            return
        if e == self.warmup_epochs:
            self.global_skip, self.local_skip, self.batches_to_wait = 4, 1, 1
        if self._cooling(e):
            self.global_skip = self.local_skip = self.batches_to_wait = 0
            return
        stable = self.plateau.test(loss)
        if stable and self.global_skip > 1:
            self.global_skip //= self.srf
            self.local_skip //= self.srf
            self.batches_to_wait -= 1
            if self.global_skip > 0:
                self.batches_to_wait = max(self.batches_to_wait, 1)
                self.local_skip = max(self.local_skip, 1)
        elif stable and self.global_skip == 1:
            self.global_skip = self.max_gs
            self.local_skip = self.max_gs // self.lsf
            self.batches_to_wait = self.max_gs // self.lsf

    def state_dict(self) -> dict[str, Any]:
        """Everything the schedule needs to continue exactly."""
        keys = ("global_skip", "local_skip", "batches_to_wait", "batch", "epoch", "send_mod")
        state: dict[str, Any] = {k: getattr(self, k) for k in keys}
        state.update(
            local_sync=self.local_sync,
            sends=self.sends,
            epoch_loss=self.epoch_loss,
            epoch_count=self.epoch_count,
            best=self.plateau.best,
            bad=self.plateau.bad,
            send_mod_m1=-1 if self.send_mod_m1 is None else self.send_mod_m1,
            pending=[] if self.pending is None else list(self.pending),
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("global_skip", "local_skip", "batches_to_wait", "batch", "epoch"):
            setattr(self, key, int(state[key]))
        self.send_mod = int(state["send_mod"])
        m1, pending = int(state["send_mod_m1"]), state["pending"]
        self.send_mod_m1 = None if m1 < 0 else m1
        self.pending = (int(pending[0]), int(pending[1])) if pending else None
        self.local_sync, self.sends = bool(state["local_sync"]), int(state["sends"])
        self.epoch_loss, self.epoch_count = float(state["epoch_loss"]), int(state["epoch_count"])
        self.plateau.best, self.plateau.bad = float(state["best"]), int(state["bad"])
