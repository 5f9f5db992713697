"""Ranks in different calls: one saving a checkpoint while its peer trains its next step.

Every rank must make the same calls (training steps, evaluations, `save`, `state_dict`,
...) in the same order. Each heartbeat says which call its rank is in and how many steps
and evaluations it has done; a rank waiting in one call while a peer, after as many steps
and evaluations, has been in another for `APART_S` waits for what will never come. Both
fail within seconds naming the two calls (before, they waited out the whole timeout,
with errors that named neither).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from myelin.errors import MyelinError

__all__ = ["APART_S", "Apart"]

APART_S = 2.0  # how long the two calls must differ: beats lag, and a peer may be arriving


class Apart:
    """Since when each peer has been in a call other than this rank's, at equal counts."""

    def __init__(self) -> None:
        self._since: dict[int, tuple[str, float]] = {}

    def check(self, liveness: Any, peers: Iterable[Any]) -> MyelinError | None:
        """The error for a peer in another call than this rank's (`liveness.where`) after
        the same counts, for APART_S or more; None otherwise. `peers`: liveness's, with the
        `where` and `at` their beats said."""
        mine, counts = liveness.where, liveness.counts
        if mine is None and not self._since:  # between calls (the loop's every wait)
            return None
        now = time.monotonic()
        for peer in peers:
            theirs = peer.where
            if peer.left or mine is None or theirs in (None, mine) or peer.at != counts:
                self._since.pop(peer.rank, None)
                continue
            seen = self._since.get(peer.rank)
            if seen is None or seen[0] != theirs:
                self._since[peer.rank] = (theirs, now)
            elif now - seen[1] >= APART_S:
                steps, evals = counts
                me = f"rank {liveness.rank} ({liveness.stage_of(liveness.rank)})"
                return MyelinError(
                    f"{me} is in {mine}, but rank {peer.rank} is in {theirs}, both after "
                    f"{steps} trainer.step and {evals} eval_step calls: every rank must make "
                    f"the same calls in the same order (save(), state_dict(), save_pretrained() "
                    f"and evaluation too, on every rank, as the steps are)"
                )
        return None
