"""Heartbeats: every rank knows within seconds that a peer died, and what it was doing.

A thread of its own (so a rank busy in user code between steps still beats) sends a
small msgpack heartbeat to every other rank every `heartbeat_s`, carrying what the rank
is doing, and takes theirs. A peer is lost when its process is gone (checked directly
for ranks on this host), nothing came from it for `peer_timeout_s`, or it said goodbye
after failing; a peer that closed its trainer on purpose has *left*, which is an error
(`PeerLeftError`) only for a rank that still needs it (`left`). The rank's launcher is
watched too: once it is gone (the rank's parent changed) the rank stops by itself
(`LauncherLostError`). The loop calls `check()` in every wait and raises the loss; if
the main thread is elsewhere, the thread signals it (SIGTERM, which the trainer turns
into the same error), and if it still has not ended after `exit_after_loss_s` the
process exits with status 1, so no rank hangs in a collective that will never finish.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import zmq

from myelin.errors import (
    LauncherLostError,
    MyelinError,
    PeerLeftError,
    PeerLostError,
    RemoteError,
)
from myelin.runtime.apart import Apart
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.hosts import host_id, pid_alive  # (importable from here too)
from myelin.runtime.launched import launcher_pid
from myelin.runtime.launched import tell as tell_launcher

__all__ = ["Liveness", "host_id", "pid_alive"]

log = logging.getLogger(__name__)

_MAX_BEAT_BYTES = 1024  # a heartbeat is a rank and a line of text; anything bigger is junk
_LOOK_S = 0.5  # how often peers' processes and the launcher are looked at, at most
# How soon a change of what this rank does goes out, at most, and the least time between
# two such beats: beating on each change (a few a step) woke this thread and its peers'
# ~10 times a step, CPU taken from compute on shared cores (4 ranks on 2: 2 ms of 25).
_NEWS_S = 0.05
_SEEN = (PeerLostError, RemoteError, LauncherLostError)  # another rank's failure, seen here
# A peer its launcher stopped (Ctrl-C, SIGTERM) is news only if this rank is not stopped
# too: launchers signal every rank at once, so this rank's own signal gets this long.
STOP_GRACE_S = 1.0


@dataclass(slots=True)
class _Peer:
    rank: int
    sock: zmq.Socket
    pid: int | None  # set when the peer runs on this host
    last: float  # monotonic time of its last heartbeat (or of our start)
    seen: bool = False
    doing: str = "starting"
    left: bool = False  # closed its trainer (or exited) and said goodbye
    stopped_at: float | None = None  # when its goodbye said its launcher stopped it
    counts: tuple[int, int] = (0, 0)  # its trainer.step and eval_step calls, when it left
    where: str | None = None  # the call it is in (a step, a save), as its last beat said
    at: tuple[int, int] = (0, 0)  # its steps and evaluations done then


class Liveness:
    """Heartbeats with every other rank of the world, on a background thread."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        stage_of: Any,
        store: Any,
        transport: Any,
        flight: FlightRecorder,
        *,
        heartbeat_s: float,
        peer_timeout_s: float,
        exit_after_loss_s: float | None,
        connect_timeout_s: float,
        prefix: str,
        flight_dir: Any = None,
    ) -> None:
        self.rank = rank
        self.stage_of = stage_of  # rank -> "stage s, replica k", for messages
        self.flight = flight
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.exit_after_loss_s = exit_after_loss_s
        self.connect_timeout_s = connect_timeout_s
        self.flight_dir = flight_dir  # a callable giving the directory, read at the end
        self.lost: MyelinError | None = None  # PeerLostError, RemoteError, LauncherLostError
        self.acknowledged = False  # the main thread has raised the loss
        self.failed: BaseException | None = None  # this rank's own failure, told at goodbye
        self.stopped = False  # this rank was stopped by its launcher: losses are expected
        self.counts = (0, 0)  # this rank's trainer.step and eval_step calls done so far
        self.where: str | None = None  # the step, evaluation or collective it is in, if any
        self._apart = Apart()
        self._peer_stopped: tuple[_Peer, dict, str] | None = None  # the first, in its grace
        self.launcher = launcher_pid()
        self._exiting = False  # closing at interpreter exit, where sys.last_value is news
        self._transport = transport
        self._ctx = transport.context
        self._stop = threading.Event()
        self._closed = False
        self._main = threading.main_thread().ident
        self._peers: dict[int, _Peer] = {}
        self._inbox = self._ctx.socket(zmq.PULL)
        try:
            self._connect(store, world_size, prefix, connect_timeout_s)
        except BaseException:  # a context with open sockets could never terminate
            for peer in self._peers.values():
                peer.sock.close(linger=0)
            self._inbox.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name=f"myelin-heartbeat-{rank}")
        self._thread.daemon = True
        self._thread.start()
        atexit.register(self._close_at_exit)  # a script that ends without close() says goodbye

    def _connect(self, store: Any, world_size: int, prefix: str, connect_timeout_s: float) -> None:
        """Bind the heartbeat inbox, publish it, and connect to every other rank's."""
        rank, transport = self.rank, self._transport
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, _MAX_BEAT_BYTES)
        transport.secure_server(self._inbox)
        address = transport.bind_like(self._inbox, "hb")
        me = {"addr": address, "pid": os.getpid(), "host": host_id()}
        store.set(f"{prefix}/hb/{rank}", msgpack.packb(me))
        keys = [f"{prefix}/hb/{r}" for r in range(world_size) if r != rank]
        store.wait(keys, timedelta(seconds=connect_timeout_s))
        start = time.monotonic()
        for r in range(world_size):
            if r == rank:
                continue
            info = msgpack.unpackb(store.get(f"{prefix}/hb/{r}"))
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)  # a dead peer's beats pile up no further
            transport.secure_client(sock, r)
            sock.connect(info["addr"])
            pid = info["pid"] if info["host"] == me["host"] else None
            self._peers[r] = _Peer(r, sock, pid, start)

    # -- the main thread's side -----------------------------------------------------------

    def check(self, where: str | None = None, strict: bool = False) -> None:
        """Raise if a peer was lost (the loop calls it in every wait), or if one left that
        this rank, in `where` (default `self.where`), still needs: one that ran fewer steps
        and evaluations, or with `strict` (a collective outside the steps) any (`left`)."""
        if self.lost is not None:
            self.acknowledged = True
            raise fresh(self.lost)
        apart = self._apart.check(self, self._peers.values())  # (runtime/apart.py)
        if apart is not None:
            raise apart
        where = where or self.where
        if where is not None and self.anyone_left:
            left = self.left(where, strict)
            if left is not None:
                raise left

    @property
    def anyone_left(self) -> bool:
        return any(p.left for p in self._peers.values())

    def parted(self, ranks: Iterable[int]) -> int:
        """How many of `ranks` said goodbye (closed their trainers)."""
        return sum(self._peers[r].left for r in ranks if r in self._peers)

    def left(self, where: str, strict: bool = False) -> PeerLeftError | None:
        """The error for a peer that left before reaching this rank's step and evaluation
        counts (or, `strict`, at all), so it cannot take part in what this rank waits for."""
        me = f"rank {self.rank} ({self.stage_of(self.rank)})"
        for peer in self._peers.values():
            if not peer.left:
                continue
            them = f"{me} is in {where}, but rank {peer.rank} ({self.stage_of(peer.rank)})"
            if peer.stopped_at is not None:  # not uneven data; within the grace, no news yet
                if time.monotonic() >= peer.stopped_at + STOP_GRACE_S:
                    return PeerLeftError(peer.rank, peer.doing, f"{them} was stopped and left")
            elif strict or sum(peer.counts) <= sum(self.counts):
                steps, evals = peer.counts
                return PeerLeftError(
                    peer.rank,
                    peer.doing,
                    f"{them} closed its trainer after {steps} trainer.step and {evals} eval_step "
                    f"calls: every rank must run the same steps and evaluations (give every "
                    f"rank data of one length, or use Trainer.fit, which stops at the shortest)",
                )
        return None

    def find_lost(self, settle_s: float = 0.0) -> MyelinError | None:
        """A loss seen by the thread, or one found now by looking at local processes;
        waits up to `settle_s` for one to show (a collective broke: a peer may be dying)."""
        deadline = time.monotonic() + settle_s
        while self.lost is None:
            self._look(time.monotonic(), beats=False)
            if self.lost is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return self.lost

    def _close_at_exit(self) -> None:
        self._exiting = True
        self.close()

    def close(self) -> None:
        """Say goodbye (so peers do not take this rank's exit for a death, or learn that it
        ended with an error) and stop."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._stop.set()
        self._thread.join(timeout=2 * self.heartbeat_s + 1)
        if not self._thread.is_alive():
            try:
                self._take()  # goodbyes that came since the thread last looked
            except zmq.ZMQError:
                pass  # the context is gone (the thread died of it): nothing more can come
        bye = msgpack.packb(self._goodbye())
        for peer in self._peers.values():
            if peer.left:  # it closed its inbox: a goodbye would only wait out the linger
                peer.sock.close(linger=0)
                continue
            try:
                peer.sock.send(bye, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            peer.sock.close(linger=200)
        self._inbox.close(linger=0)

    def _goodbye(self) -> dict[str, Any]:
        """The last beat: what this rank did, its counts, and how it failed if it did. A
        script that ended with an error of its own failed first (the launcher is told so
        now, before the slow exit); one that ended with an error after a peer was lost
        only saw that loss, so it names the lost rank, for the peers to relay."""
        failed, doing = self.failed, "closed its trainer"
        if failed is None and self._exiting:  # the script itself ended with an error
            failed = getattr(sys, "last_value", None)
            if failed is not None:
                doing = f"raised {type(failed).__name__} in its script, outside the trainer"
                if not isinstance(failed, _SEEN) and self.find_lost() is None:
                    tell_launcher(f"failed {self.rank}")  # its own error, not a loss seen
        beat: dict[str, Any] = {"rank": self.rank, "doing": doing, "bye": True}
        beat["counts"] = list(self.counts)
        if failed is not None:
            beat["failed"] = f"{type(failed).__name__}: {failed}"[:300]
            beat["stopped"] = self.stopped
            beat["told"] = self.failed is not None  # the trainer sent its peers an abort
            lost = failed
            if self.failed is None and not isinstance(failed, PeerLostError):
                lost = self.lost  # the script's error came after a loss: most likely of it
            if isinstance(lost, PeerLostError):  # so peers relay the loss, not a failure
                beat["lost"], beat["lost_doing"] = lost.rank, lost.doing[:200]
        return beat

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        next_beat, next_look, told, last = 0.0, 0.0, None, -_NEWS_S
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                # Beat on time, and also soon after the rank starts something new (at most
                # one such beat per _NEWS_S, the latest news), so peers know what it was
                # doing if it dies.
                news = self.flight.doing is not told and now >= last + _NEWS_S
                if now >= next_beat or news:
                    told = self.flight.doing
                    self._beat(told)
                    last, next_beat = now, now + self.heartbeat_s
                cooling = last + _NEWS_S - now  # news goes out when this ends, else a look
                wait_s = min(cooling if cooling > 0 else _NEWS_S, next_beat - now)
                # Peers' beats are read when this thread wakes anyway (a few times a
                # heartbeat), not each as it comes: a wake-up each, ~3 a step per peer.
                if self._stop.wait(max(0.001, wait_s)):
                    return
                self._take()
                if time.monotonic() >= next_look:  # peers' processes once a beat, not 10 ms
                    self._look(time.monotonic(), beats=True)
                    next_look = time.monotonic() + min(self.heartbeat_s, _LOOK_S)
                if self.lost is not None:
                    self._escalate()
                    return
        except zmq.ContextTerminated:
            return
        except Exception:  # the watchdog must never take the rank down by itself
            log.exception("rank %d: heartbeat thread failed", self.rank)

    def _beat(self, doing: str) -> None:
        where = self.where[:200] if self.where else None
        beat = msgpack.packb({"rank": self.rank, "doing": doing[:200], "where": where,
                              "counts": list(self.counts)})  # fmt: skip
        for peer in self._peers.values():
            if peer.left:
                continue
            try:
                peer.sock.send(beat, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the peer is not taking them: its timeout will tell

    def _take(self) -> None:
        while True:
            try:
                raw = self._inbox.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            beat = _decode_beat(raw)
            peer = self._peers.get(beat.get("rank")) if beat is not None else None
            if peer is None:
                log.debug("rank %d: ignored a malformed heartbeat", self.rank)
                continue
            peer.last = time.monotonic()
            peer.seen = True
            peer.doing = beat["doing"]
            peer.where = beat["where"] if isinstance(beat.get("where"), str) else None
            peer.at = _counts(beat.get("counts"))
            if beat.get("bye") is True:
                peer.left = True
                peer.counts = _counts(beat.get("counts"))
                failed = beat.get("failed")
                if isinstance(failed, str) and self.lost is None:
                    self._failed(peer, beat, failed)

    def _failed(self, peer: _Peer, beat: dict, failed: str) -> None:
        """A peer's goodbye says it failed: a loss it saw is relayed as that loss (trainer's
        or script's: a survivor is never blamed for it); a stop by its launcher is news only
        after the grace, if this rank was not stopped too; else its own failure (`_settle`)."""
        lost = beat.get("lost")  # a rank, or -1: the EASGD hub (hub_client.HUB_RANK)
        if type(lost) is int and lost not in (self.rank, peer.rank) and lost >= -1:
            doing = str(beat.get("lost_doing", "unknown"))
            self.lost = PeerLostError(lost, doing, f"rank {peer.rank} reports: {failed}")
            self.flight.note("rank %d failed: %s", peer.rank, failed)
        elif beat.get("stopped") is True:
            peer.stopped_at = time.monotonic()  # (`left` takes it for no uneven data)
            self._peer_stopped = self._peer_stopped or (peer, beat, failed)
        else:
            self._settle(peer, beat, failed)

    def _settle(self, peer: _Peer, beat: dict, failed: str) -> None:
        """The peer's own failure: a RemoteError if its trainer told it (the abort), else lost."""
        if beat.get("told") is True:  # (`told`: its trainer sent its peers an abort)
            self.lost = RemoteError(peer.rank, failed)
            self.flight.note("rank %d failed: %s", peer.rank, failed)
        else:
            self._lose(peer, f"it ended with an error: {failed}", quiet=self.stopped)

    def _look(self, now: float, beats: bool) -> None:
        if self.launcher is not None and self.lost is None and os.getppid() != self.launcher:
            self.lost = LauncherLostError(
                f"rank {self.rank} lost its launcher (pid {self.launcher}, myelin run or "
                f"torchrun): it was killed, so nothing could stop this rank; stopping"
            )
            self.flight.note("lost its launcher (pid %d)", self.launcher)
            log.error("%s", self.lost)
            return
        for peer in self._peers.values():
            if peer.left or self.lost is not None:
                continue
            if peer.pid is not None and not pid_alive(peer.pid):
                self._lose(peer, f"its process (pid {peer.pid}) is gone")
            elif beats:
                quiet = now - peer.last
                limit = (
                    self.peer_timeout_s
                    if peer.seen
                    else max(self.peer_timeout_s, self.connect_timeout_s)
                )
                if quiet > limit:
                    self._lose(peer, f"nothing came from it for {quiet:.1f}s")
        pending = self._peer_stopped  # after the losses: a peer gone meanwhile comes first
        due = pending is not None and now >= pending[0].stopped_at + STOP_GRACE_S
        if due and self.lost is None and not self.stopped:
            self._settle(*pending)  # this rank was not stopped with it: its error is news

    def _lose(self, peer: _Peer, why: str, quiet: bool = False) -> None:
        self.lost = PeerLostError(
            peer.rank,
            peer.doing,
            f"rank {self.rank} lost rank {peer.rank} ({self.stage_of(peer.rank)}): {why}; "
            f"it was last {peer.doing}"
            + (f" ({time.monotonic() - peer.last:.1f}s before)" if peer.seen else ""),
        )
        self.flight.note(f"lost rank {peer.rank}: {why}")
        log.log(logging.DEBUG if quiet or self.stopped else logging.ERROR, "%s", self.lost)

    def _escalate(self) -> None:
        """Make the main thread stop: let its loop see the loss, then signal it, then exit."""
        deadline = time.monotonic() + (self.exit_after_loss_s or 0)
        self._stop.wait(min(1.0, self.heartbeat_s * 2))
        if self.acknowledged or self._stop.is_set():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.pthread_kill(self._main, signal.SIGTERM)
        if self.exit_after_loss_s is None:
            return
        while time.monotonic() < deadline:
            if self._stop.wait(0.1):
                return
        if self.flight_dir is not None:
            try:
                self.flight.dump(self.flight_dir(), self.lost)
            except Exception:  # the exit below must happen whatever the disk says
                log.exception("rank %d: could not write the flight record", self.rank)
        sys.stderr.write(f"myelin.errors.{type(self.lost).__name__}: {self.lost} (exiting)\n")
        sys.stderr.flush()
        os._exit(1)


def fresh(error: MyelinError) -> MyelinError:
    """A new exception like `error`, to raise again without piling up tracebacks."""
    if isinstance(error, PeerLostError):
        return type(error)(error.rank, error.doing, str(error))
    if isinstance(error, RemoteError):
        return RemoteError(error.rank, error.detail)
    return type(error)(str(error))


def _counts(value: Any) -> tuple[int, int]:
    """A goodbye's (steps, evaluations), or (0, 0) if it says something else."""
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    return 0, 0


def _decode_beat(raw: bytes) -> dict | None:
    """A heartbeat as {rank: int, doing: str[, bye: True]}, or None if it is anything else."""
    try:
        beat = msgpack.unpackb(raw, raw=False, max_str_len=512, max_map_len=12, strict_map_key=True)
    except Exception:
        return None
    if not isinstance(beat, dict) or type(beat.get("rank")) is not int:
        return None
    if not isinstance(beat.get("doing"), str):
        return None
    return beat
