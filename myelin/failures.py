"""What a rank does when it fails, so every rank raises a clear error within seconds.

A failed step becomes the error to raise: a lost peer (found by heartbeats) named as
`PeerLostError`, an exhausted device as `DeviceMemoryError`. The rank tells every other
rank (an `abort` control message, so none waits for it until a timeout) and writes its
flight record, whose last lines go into the error's notes. A launcher's SIGTERM, sent
when another rank failed, is raised as its reason instead of killing the rank silently.
After a failure the pipeline is broken: every later call says so.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import torch

from myelin.errors import DeviceMemoryError, MyelinError, PeerLostError, RemoteError
from myelin.offload.budget import DeviceBudget
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.liveness import Liveness
from myelin.runtime.transport import Transport

__all__ = ["Failures"]

log = logging.getLogger(__name__)


class Failures:
    """One rank's failure handling; the trainer hands it the parts as it builds them."""

    def __init__(self, rank: int, world_size: int, flight_dir: Path) -> None:
        self.rank = rank
        self.world_size = world_size
        self.flight = FlightRecorder(rank)
        self.flight_dir = flight_dir  # where the record goes; `myelin train` moves it
        self.failed: BaseException | None = None
        self.transport: Transport | None = None
        self.liveness: Liveness | None = None
        self.budget: DeviceBudget | None = None
        self._old_sigterm: Any = None

    def check_usable(self) -> None:
        """Raise if an earlier step failed and left the pipeline broken."""
        if self.failed is not None:
            raise MyelinError(
                f"an earlier step failed and left the pipeline broken: {self.failed}"
            ) from self.failed

    def fail(self, exc: BaseException, doing: str) -> BaseException:
        """Turn a failure into the error to raise: a lost peer (found by heartbeats) or an
        exhausted device named as such. Tell the other ranks, and write the flight record
        (its last lines go into the error's notes)."""
        error = exc
        if isinstance(exc, torch.OutOfMemoryError) and self.budget is not None:
            error = self.budget.describe_oom(exc, doing)
        lost = self.liveness.find_lost() if self.liveness is not None else None
        if lost is not None and not isinstance(exc, (PeerLostError, DeviceMemoryError)):
            self.liveness.acknowledged = True
            error = PeerLostError(lost.rank, lost.doing, str(lost))
        self.failed = error
        if not isinstance(error, RemoteError):
            self.abort(error)
        if isinstance(error, Exception):
            self.flight.note(f"failed in {doing}: {type(error).__name__}")
            try:
                path = self.flight.dump(self.flight_dir, error)
                where = f"written to {path}"
            except Exception as write_exc:  # never hide the real error behind this one
                where = f"could not be written to {self.flight_dir}: {write_exc}"
            error.add_note(
                f"flight record of rank {self.rank}, last events:\n{self.flight.summary()}\n"
                f"(whole record {where})"
            )
        return error

    def abort(self, exc: BaseException) -> None:
        """Tell every other rank this one failed, so none waits for it until a timeout."""
        if self.transport is None:
            return
        detail = f"{type(exc).__name__}: {exc}"[:2000]
        meta: dict[str, Any] = {"op": "abort", "error": detail}
        if isinstance(exc, PeerLostError):
            meta.update(lost=exc.rank, doing=exc.doing[:200])
        for r in range(self.world_size):
            if r != self.rank:
                try:
                    self.transport.send_control(r, meta)
                except Exception as send_exc:  # best effort: the peer may be gone too
                    log.debug("rank %d: could not tell rank %d: %s", self.rank, r, send_exc)

    def catch_sigterm(self) -> None:
        """Launchers stop every rank with SIGTERM when one fails; raise the reason instead
        of dying silently: PeerLostError when a peer is gone."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the user's own handler stays

        def on_sigterm(signum: int, frame: Any) -> None:
            lost = self.liveness.find_lost() if self.liveness is not None else None
            if lost is not None:
                self.liveness.acknowledged = True
                raise PeerLostError(lost.rank, lost.doing, str(lost))
            raise MyelinError(f"rank {self.rank} got SIGTERM while {self.flight.doing}")

        self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def release_sigterm(self) -> None:
        """Put back the SIGTERM handler that was there before `catch_sigterm`."""
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
