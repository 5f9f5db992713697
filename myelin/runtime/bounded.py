"""Blocking waits outside the event loop, bounded and aware of lost and departed peers.

torch.distributed's waits (a store key, a barrier, a gloo collective) block in C++, where
Python can neither run the SIGTERM handler a launcher relies on nor notice that a peer
died. Here every such wait is a loop of short slices. Between slices signal handlers run,
the heartbeat thread's verdict is checked (a lost peer raises `PeerLostError`), a peer the
wait needs that closed its trainer ends it (`PeerLeftError`: the ranks ran different
steps), and past its deadline the wait raises `DeadlineError` saying what never came.
Used by the replicas' all-reduce, the profile gather, checkpoints' barriers and the
agreements of `fit`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from myelin.errors import DeadlineError, MyelinError
from myelin.runtime.liveness import fresh

__all__ = ["Waits", "SLICE_S"]

SLICE_S = 0.05  # longest stretch in C++ without a look at signals and peers
_EXPLAIN_S = 1.0  # how long a failed collective waits to learn which peer broke it
_LEFT_GRACE_S = 0.2  # a peer that left: what it sent before may still be on its way
_STORE_POLL_S = (0.001, 0.02)  # a store key is polled (each look is a round trip): 1 ms, then 20


class Waits:
    """Bounded, liveness-aware waits for one rank.

    liveness: the rank's heartbeats (runtime/liveness.py), or None in a one-rank world.
    me: how this rank is named in errors, e.g. "rank 0 (stage 0, replica 0)".
    timeout_s: the deadline of a wait that is given none.
    """

    def __init__(self, liveness: Any, me: str, timeout_s: float) -> None:
        self.liveness = liveness
        self.me = me
        self.timeout_s = timeout_s

    def check(self, what: str | None, strict: bool = True) -> None:
        """Raise if a peer was lost, or left while this rank, in `what`, still needs it
        (`strict`: any peer that left; else one that ran fewer steps, see liveness.py)."""
        if self.liveness is not None:
            self.liveness.check(what, strict)

    def until(
        self,
        done: Callable[[float], bool],
        what: str | None,
        strict: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        """Call `done(slice_s)` (it may block up to slice_s) until it is true.

        An error from `done` while a peer is lost becomes that loss, so a collective that
        broke because a peer died says which peer. A peer that left gets one more slice
        (what it sent before leaving may still be arriving).
        """
        waited = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + waited
        while True:
            if self._try(done, what, strict):
                return
            if self.liveness is not None and self.liveness.anyone_left:
                time.sleep(_LEFT_GRACE_S)
                if self._try(done, what, strict):
                    return
            self.check(what, strict)
            if time.monotonic() > deadline:
                where = what or (self.liveness.where if self.liveness is not None else None)
                raise DeadlineError(f"{self.me} waited {waited:.0f}s in {where or 'a wait'}")

    def _try(self, done: Callable[[float], bool], what: str | None, strict: bool) -> bool:
        """One slice of `done`; its failure becomes the loss or departure behind it."""
        try:
            return done(SLICE_S)
        except MyelinError:
            raise
        except Exception as exc:
            self._explain(exc, what, strict)
            raise

    def _explain(self, exc: Exception, what: str | None, strict: bool) -> None:
        """Raise the loss or departure behind a failed collective, if the heartbeats know
        or learn one within a second (a peer's goodbye may come after its sockets closed)."""
        if self.liveness is None:
            return
        deadline = time.monotonic() + _EXPLAIN_S
        while True:
            lost = self.liveness.find_lost()
            if lost is not None:
                self.liveness.acknowledged = True
                raise fresh(lost) from exc
            try:
                self.check(what, strict)
            except MyelinError as left:
                raise left from exc
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def issue(
        self, t: Any, group: Any = None, op: Any = None, what: str | None = None, strict=False
    ) -> Any:
        """Start an all-reduce of `t` (async); a broken connection can fail the call itself,
        and then the peer behind it is named."""
        op = dist.ReduceOp.SUM if op is None else op
        begin = lambda: dist.all_reduce(t, op=op, group=group, async_op=True)  # noqa: E731
        return self.start(begin, what, strict)

    def start(self, begin: Callable[[], Any], what: str | None = None, strict=False) -> Any:
        """Start a collective (`begin()` returns its Work); a failure of the call itself
        names the peer behind it."""
        try:
            return begin()
        except MyelinError:
            raise
        except Exception as exc:
            self._explain(exc, what, strict)
            raise

    def all_reduce(
        self, t: Any, op: Any = None, group: Any = None, what: str | None = None, strict=True
    ) -> None:
        """An all-reduce of `t` in place that a lost or departed peer cannot hang."""
        self.work(self.issue(t, group, op, what, strict), what, strict)

    def work(self, work: Any, what: str | None = None, strict: bool = True) -> None:
        """Wait for a torch.distributed Work (async_op=True), a slice at a time."""

        def done(slice_s: float) -> bool:
            if work.is_completed():
                work.wait()  # raises the collective's own error, if it failed
                return True
            try:
                work.wait(timeout=timedelta(seconds=slice_s))
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
                if not work.is_completed():
                    return False
                work.wait()  # it finished just after the slice ran out: its own result
            return True

        self.until(done, what, strict)

    def point_to_point(self, begin: Callable[[], Any], what: str, strict: bool = False) -> None:
        """Start a send or receive (`begin()`: dist.isend/irecv) and wait for it whole: gloo
        closes the pair when a point-to-point wait times out, so it cannot be waited for a
        slice at a time. Call it with every peer known to be there (after a `barrier`);
        a peer lost during it breaks the transfer, and the loss is named."""
        work = self.start(begin, what, strict)
        try:
            work.wait()
        except MyelinError:
            raise
        except Exception as exc:
            self._explain(exc, what, strict)
            raise

    def keys(self, store: Any, keys: list[str], what: str, timeout_s: float | None = None) -> None:
        """Wait until every key is set in the torch.distributed store."""
        pause = iter((_STORE_POLL_S[0],) * 20)

        def done(slice_s: float) -> bool:
            if store.check(keys):
                return True
            time.sleep(min(slice_s, next(pause, _STORE_POLL_S[1])))
            return False

        self.until(done, what, True, timeout_s)

    def barrier(self, what: str, group: Any = None) -> None:
        """A barrier over `group` (default: every rank) that a lost peer cannot hang."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            self.work(dist.barrier(group=group, async_op=True), what)
