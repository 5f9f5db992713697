"""What a rank does when it fails, so every rank raises a clear error within seconds.

A failed step becomes the error to raise: a lost peer (found by heartbeats) named as
`PeerLostError`, an exhausted device as `DeviceMemoryError`. The rank tells every other
rank (an `abort` control message, so none waits for it until a timeout) and writes its
flight record, whose last lines go into the error's notes. A launcher's SIGTERM, sent
when another rank failed, is raised as its reason instead of killing the rank silently;
`myelin run`'s SIGINT (the user pressed Ctrl-C) ends the rank quietly: the launcher prints
the one line. Either way the rank writes its flight record wherever the signal found it
and tells the launcher where (runtime/launched.py). Once the interpreter exits, SIGTERM is
ignored: the rank is ending anyway, and an error raised in an exit handler would only cut
its goodbye short. After a failure the pipeline is broken: every later call says so
(a trainer of one rank forgets a step whose update had not begun: retry.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch

from myelin.errors import (
    CheckpointError,
    ConfigError,
    DeviceMemoryError,
    MyelinError,
    PeerLostError,
    RemoteError,
)
from myelin.offload.budget import DeviceBudget
from myelin.runtime import launched
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import World, abandon_groups
from myelin.runtime.liveness import Liveness, fresh
from myelin.runtime.transport import Transport

__all__ = ["Failures"]

log = logging.getLogger(__name__)

# Errors about the caller's own arguments or files, which every rank typically raises alike:
# not a failure of the pipeline to tell the peers and the launcher of.
_OWN = (ConfigError, CheckpointError)


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
        self.world: World | None = None
        self.budget: DeviceBudget | None = None
        self._old: dict[int, Any] = {}  # signal -> the handler that was there before
        self.signalled: BaseException | None = None  # raised by a handler, maybe swallowed

    def connected(self, transport: Transport, liveness: Liveness, world: World) -> None:
        """The rank's peers are reachable: failures are told to them from now on."""
        self.transport, self.liveness, self.world = transport, liveness, world

    @property
    def ending(self) -> bool:
        """This rank failed, or a signal stopped it while it has peers (who were stopped
        too, or are told): its close gathers nothing with them."""
        return self.failed is not None or (
            self.signalled is not None and self.transport is not None
        )

    def enter(self, where: str) -> None:
        """The rank starts a step or evaluation (`where`, e.g. "training step 3"). A
        signal's error that Python swallowed (raised inside a weakref callback or a
        destructor, where exceptions are only printed) is raised here, at the latest."""
        if self.signalled is not None:
            error, self.signalled = self.signalled, None
            raise error
        if self.liveness is not None:
            self.liveness.where = where

    def leave(self, steps: int, evals: int) -> None:
        """The step is over: `steps` trainer.step and `evals` eval_step calls done."""
        done = _count(steps, "training step")
        if evals:
            done += f" and {_count(evals, 'evaluation')}"
        self.flight.now(f"between steps, after {done}")
        if self.liveness is not None:
            self.liveness.where = None
            self.liveness.counts = (steps, evals)

    def check_usable(self) -> None:
        """Raise if an earlier step failed and left the pipeline broken."""
        if self.failed is not None:
            raise MyelinError(
                f"an earlier step failed and left the pipeline broken: {self.failed}"
            ) from self.failed

    def script_failed(self, error: Exception) -> None:
        """The script raised inside `with Trainer(...)`: with peers, this rank failed (they
        are told now, as of a failed step, and close gathers nothing), not a clean close."""
        if self.world_size > 1 and self.failed is None and not isinstance(error, _OWN):
            self.fail(error, "its script, inside `with Trainer(...)`")

    def describe(self, exc: BaseException, doing: str) -> BaseException:
        """The error to raise for `exc`: an exhausted device named as such."""
        if isinstance(exc, torch.OutOfMemoryError) and self.budget is not None:
            return self.budget.describe_oom(exc, doing)
        return exc

    def fail(self, exc: BaseException, doing: str) -> BaseException:
        """Turn a failure into the error to raise: a lost peer (found by heartbeats) or an
        exhausted device named as such. Tell the other ranks, and write the flight record
        (its last lines go into the error's notes)."""
        error = self.describe(exc, doing)
        # A rank Ctrl-C interrupted keeps that as its error (a peer's of the same Ctrl-C is
        # no news); one its launcher stopped (or interrupted) did not fail first.
        interrupted = isinstance(exc, KeyboardInterrupt)
        stopped = interrupted or (self.liveness is not None and self.liveness.stopped)
        if interrupted:  # (Python's own handler too: peers' stops are no news from now on)
            self._stopped()
        lost = self.liveness.find_lost() if self.liveness is not None else None
        named = isinstance(exc, (PeerLostError, DeviceMemoryError))  # (they say what failed)
        if lost is not None and not interrupted and not named:
            self.liveness.acknowledged = True
            error = fresh(lost)
        self.failed = error
        if self.liveness is not None:
            self.liveness.failed = error
        if isinstance(error, PeerLostError) and self.world is not None:
            abandon_groups(self.world)  # a gloo thread may wait on the silent peer forever
        if not isinstance(error, RemoteError):  # (a RemoteError's rank has told already)
            relayed = isinstance(error, PeerLostError)  # (the lost rank failed first)
            if not relayed and not stopped:
                launched.tell(f"failed {self.rank}")  # the launcher stops the others now
            self.abort(error, stopped and not relayed)  # a relayed loss is news at once
        if isinstance(error, Exception) and not getattr(error, "_myelin_recorded", False):
            self.flight.note(f"failed in {doing}: {type(error).__name__}")
            self.record(error)
        return error

    @contextlib.contextmanager
    def collective(self, doing: str) -> Iterator[None]:
        """Around a call every rank makes together (a checkpoint save or load, a profile
        gather): in a world of several ranks a failure in it is this rank's failure, told
        to its peers and the launcher as a failed step's is (a lost peer named as such),
        so none waits for this rank, and none blames it for a loss it only saw. A bad
        argument or checkpoint (ConfigError, CheckpointError: found before this rank's
        state changes, as every rank finds it) leaves the trainer usable."""
        if self.transport is None:  # one rank: nobody to tell, and the trainer stays usable
            yield
            return
        live = self.liveness
        outer, before = (live.where if live is not None else None), self.flight.doing
        if live is not None:  # the peers' heartbeats say so (runtime/apart.py)
            live.where = doing
        self.flight.now(f"in {doing}")  # (what a lost rank's peers and its errors name)
        try:
            yield
        except (ConfigError, CheckpointError):
            raise
        except BaseException as exc:
            self.raise_failed(exc, doing)
        finally:
            self.flight.now(before)
            if live is not None:
                live.where = outer

    def raise_failed(self, exc: BaseException, doing: str, passing: bool = False) -> NoReturn:
        """`fail`, then raise what it made of `exc` (from `exc`), or `exc` itself. A
        `passing` failure (one rank's, which it recovered from) is named but breaks nothing."""
        if exc is self.signalled:  # it came through: no need to raise it again
            self.signalled = None
        if passing:
            self.flight.note(f"failed in {doing}, forgotten: {type(exc).__name__}")
        error = self.describe(exc, doing) if passing else self.fail(exc, doing)
        if isinstance(error, Exception) and not hasattr(error, "_myelin_recorded"):
            self._name_where(error, doing)
        try:
            if error is exc:
                raise exc
            raise error from exc
        finally:  # the traceback holds this frame: its locals must not hold the error
            del error, exc

    def _name_where(self, error: Exception, doing: str) -> None:
        """A note on an error without a flight record (one rank's own, raised as it was):
        where it failed, the action too when it failed in one ("running 1B0 ...")."""
        note = f"myelin: rank {self.rank} failed in "
        if not any(n.startswith(note) for n in getattr(error, "__notes__", ())):
            now = self.flight.doing
            error.add_note(note + (now if doing in now else doing))

    def record(self, error: BaseException) -> None:
        """Write the flight record for `error`, tell the launcher where, and put the
        record's last lines into the error's notes."""
        try:
            path = self.flight.dump(self.flight_dir, error)
            where = f"written to {path}"
            launched.tell(f"flight {self.rank} {path}")
        except Exception as write_exc:  # never hide the real error behind this one
            where = f"could not be written to {self.flight_dir}: {write_exc}"
        error._myelin_recorded = True  # type: ignore[attr-defined]
        error.add_note(
            f"flight record of rank {self.rank}, last events:\n{self.flight.summary()}\n"
            f"(whole record {where})"
        )

    def abort(self, exc: BaseException, stopped: bool = False) -> None:
        """Tell every other rank this one failed (or, `stopped`, was stopped by its
        launcher), so none waits for it until a timeout."""
        if self.transport is None:
            return
        detail = f"{type(exc).__name__}: {exc}"[:2000]
        meta: dict[str, Any] = {"op": "abort", "error": detail, "stopped": stopped}
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
        of dying silently: PeerLostError when a peer is gone, LauncherLostError when the
        launcher is. Under `myelin run`, SIGINT (Ctrl-C) ends the rank quietly."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
        if launched.under_myelin_run() and signal.getsignal(signal.SIGINT) in (
            signal.default_int_handler,
            signal.SIG_DFL,
        ):
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        if self._old:
            atexit.register(self._ignore_sigterm)  # after Liveness's: it runs before it

    def _ignore_sigterm(self) -> None:
        """At interpreter exit: the launcher's SIGTERM (another rank failed) finds this rank
        ending already. Raising it there would break off an exit handler (the heartbeats'
        goodbye) with an error nobody catches, and once Python restores default handlers
        late in its exit the signal would kill the rank (exit code -15, as if the launcher
        had had to stop it), hiding its own exit status. Ignored, the rank ends as it was
        ending; a launcher still kills one that takes too long."""
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.failed is not None:
            return  # this rank has its own error and is on its way out: let it finish
        lost = self.liveness.find_lost() if self.liveness is not None else None
        if lost is not None:
            self.liveness.acknowledged = True
            error: BaseException = fresh(lost)
        else:
            self._stopped()
            error = MyelinError(
                f"rank {self.rank} was stopped by its launcher (SIGTERM) while {self.flight.doing}"
            )
        self.flight.note(f"signal {signal.Signals(signum).name}: {type(error).__name__}")
        self.record(error)
        self.signalled = error
        raise error

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self._stopped()
        error = KeyboardInterrupt(f"rank {self.rank} interrupted while {self.flight.doing}")
        self.flight.note("interrupted (SIGINT from myelin run)")
        self.record(error)
        previous = sys.excepthook

        def quiet(kind: type, value: BaseException, tb: Any) -> None:
            if not issubclass(kind, KeyboardInterrupt):  # myelin run prints the one line
                previous(kind, value, tb)

        sys.excepthook = quiet
        self.signalled = error
        raise error

    def _stopped(self) -> None:
        """This rank is being stopped: the peers it loses from now on are no news."""
        if self.liveness is not None:
            self.liveness.stopped = True

    def release_sigterm(self) -> None:
        """Put back the signal handlers that were there before `catch_sigterm`."""
        atexit.unregister(self._ignore_sigterm)
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old.clear()


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")
