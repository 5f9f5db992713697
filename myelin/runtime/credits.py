"""Flow control between ranks in bytes, since ZeroMQ's high-water mark counts messages.

A sender keeps at most `max_inflight_bytes` unacknowledged per receiver (the transport
queues the rest). The receiver owes each sender credits for the bytes it took, and the
shared-memory slots whose tensors died; `Ledger` keeps those debts and pays them in
batches, at most one control message per peer per 5 ms, at once when a debt is
large (an eighth of the credit budget, 4 MiB of slots) so a sender never starves and
reuses slots while they are still warm in its cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ledger", "SETTLE_DELAY_S"]

_FREE_CHUNK = 4096  # freed slots per control message, well under the header limit
SETTLE_DELAY_S = 0.005  # how long small credits and freed slots may wait to be batched
_SLOTS_BATCH = 4 * 2**20  # freed slot bytes that go back at once, aged or not


@dataclass(slots=True)
class _Debt:
    """What this rank owes one sender: credits for bytes taken, and slots freed."""

    credit: int = 0
    slots: list[int] = field(default_factory=list)
    slot_bytes: int = 0


class Ledger:
    """What this rank owes each sender, paid back in batches (see the module docstring)."""

    def __init__(self, max_inflight_bytes: int, shm_bytes: int) -> None:
        self._big_credit = max_inflight_bytes // 8
        self._big_slots = min(shm_bytes // 8, _SLOTS_BATCH)  # slots reused warm in cache
        self._debts: dict[int, _Debt] = {}
        self._since: float | None = None  # when the oldest unpaid debt arose

    def _debt(self, src: int) -> _Debt:
        if self._since is None:
            self._since = time.monotonic()
        debt = self._debts.get(src)
        if debt is None:
            debt = self._debts[src] = _Debt()
        return debt

    def took(self, src: int, nbytes: int) -> None:
        """This rank took `nbytes` of tensors from `src`: credit them back."""
        self._debt(src).credit += nbytes

    def freed(self, src: int, offset: int, nbytes: int) -> None:
        """The tensor in `src`'s slot at `offset` died: give the slot back."""
        debt = self._debt(src)
        debt.slots.append(offset)
        debt.slot_bytes += nbytes

    def next_wake(self) -> float:
        """When the oldest debt must be paid (monotonic clock); inf when nothing is owed."""
        return math.inf if self._since is None else self._since + SETTLE_DELAY_S

    def due(self, now: float) -> bool:
        """Whether to pay now: something is owed, and it has aged or grown large."""
        if self._since is None:
            return False
        return now - self._since >= SETTLE_DELAY_S or any(
            d.credit >= self._big_credit or d.slot_bytes >= self._big_slots
            for d in self._debts.values()
        )

    def pay(
        self, send: Callable[[int, dict[str, Any]], None], token_of: Callable[[int], Any]
    ) -> None:
        """Pay every debt: `send(src, meta)` credit messages, freed slots in chunks, each with
        the segment's token from `token_of(src)` (its secret: no forged frees)."""
        for src, debt in self._debts.items():
            meta: dict[str, Any] = {"op": "credit", "bytes": debt.credit}
            if debt.slots:
                meta["token"] = token_of(src)
            for i in range(0, len(debt.slots), _FREE_CHUNK):
                send(src, {**meta, "free": debt.slots[i : i + _FREE_CHUNK]})
                meta["bytes"] = 0
            if not debt.slots:
                send(src, meta)
        self._debts.clear()
        self._since = None
