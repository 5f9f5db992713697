"""Heartbeats: every rank knows within seconds that a peer died, and what it was doing.

A thread of its own (so a rank busy in user code between steps still beats) sends a
small msgpack heartbeat to every other rank every `heartbeat_s`, carrying what the rank
is doing, and takes theirs. A peer is lost when its process is gone (checked directly
for ranks on this host) or nothing came from it for `peer_timeout_s`. The loop calls
`check()` in every wait and raises `PeerLostError`; if the main thread is elsewhere,
the thread signals it (SIGTERM, which the trainer turns into the same error), and if
it still has not ended after `exit_after_loss_s` the process exits with status 1, so
no rank hangs in a collective that will never finish.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import zmq

from myelin.errors import PeerLostError
from myelin.runtime.flight import FlightRecorder

__all__ = ["Liveness", "host_id", "pid_alive"]

log = logging.getLogger(__name__)

_MAX_BEAT_BYTES = 1024  # a heartbeat is a rank and a line of text; anything bigger is junk
_NEWS_S = 0.01  # how soon a change of what this rank does goes out, at most


def host_id() -> str:
    """This host as ranks must share it to see each other's processes and abstract ipc
    sockets: the hostname, the network namespace and the pid namespace."""
    spaces = []
    for ns in ("net", "pid"):
        try:
            spaces.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            spaces.append("-")
    return f"{socket.gethostname()}/{'/'.join(spaces)}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (killed, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@dataclass(slots=True)
class _Peer:
    rank: int
    sock: zmq.Socket
    pid: int | None  # set when the peer runs on this host
    last: float  # monotonic time of its last heartbeat (or of our start)
    seen: bool = False
    doing: str = "starting"
    left: bool = False  # closed its trainer on purpose


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
        self.lost: PeerLostError | None = None
        self.acknowledged = False  # the main thread has raised the loss
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
        atexit.register(self.close)  # a script that ends without close() still says goodbye

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

    def check(self) -> None:
        """Raise PeerLostError if a peer was lost (called by the loop in every wait)."""
        if self.lost is not None:
            self.acknowledged = True
            raise self.lost

    def find_lost(self) -> PeerLostError | None:
        """A loss seen by the thread, or one found now by looking at local processes."""
        if self.lost is None:
            self._look(time.monotonic(), beats=False)
        return self.lost

    def close(self) -> None:
        """Say goodbye (so peers do not take this rank's exit for a death) and stop."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        self._thread.join(timeout=2 * self.heartbeat_s + 1)
        bye = msgpack.packb({"rank": self.rank, "doing": "closed its trainer", "bye": True})
        for peer in self._peers.values():
            try:
                peer.sock.send(bye, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            peer.sock.close(linger=200)
        self._inbox.close(linger=0)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        next_beat, told = 0.0, None
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                # Beat on time, and also soon after the rank starts something new, so
                # peers know what it was doing if it dies.
                on_time = now >= next_beat
                if on_time or self.flight.doing is not told:
                    told = self.flight.doing
                    self._beat(told)
                    next_beat = now + self.heartbeat_s
                wait_ms = min(_NEWS_S, next_beat - now) * 1000
                if dict(poller.poll(timeout=max(1, int(wait_ms)))):
                    self._take()
                if on_time:  # look at peers' processes once a beat, not every 10 ms
                    self._look(time.monotonic(), beats=True)
                if self.lost is not None:
                    self._escalate()
                    return
        except zmq.ContextTerminated:
            return
        except Exception:  # the watchdog must never take the rank down by itself
            log.exception("rank %d: heartbeat thread failed", self.rank)

    def _beat(self, doing: str) -> None:
        beat = msgpack.packb({"rank": self.rank, "doing": doing[:200]})
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
            peer.left = peer.left or beat.get("bye") is True

    def _look(self, now: float, beats: bool) -> None:
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

    def _lose(self, peer: _Peer, why: str) -> None:
        self.lost = PeerLostError(
            peer.rank,
            peer.doing,
            f"rank {self.rank} lost rank {peer.rank} ({self.stage_of(peer.rank)}): {why}; "
            f"it was last {peer.doing}"
            + (f" ({time.monotonic() - peer.last:.1f}s before)" if peer.seen else ""),
        )
        self.flight.note(f"lost rank {peer.rank}: {why}")
        log.error("%s", self.lost)

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
        sys.stderr.write(f"myelin.errors.PeerLostError: {self.lost} (exiting)\n")
        sys.stderr.flush()
        os._exit(1)


def _decode_beat(raw: bytes) -> dict | None:
    """A heartbeat as {rank: int, doing: str[, bye: True]}, or None if it is anything else."""
    try:
        beat = msgpack.unpackb(raw, raw=False, max_str_len=512, max_map_len=4, strict_map_key=True)
    except Exception:
        return None
    if not isinstance(beat, dict) or type(beat.get("rank")) is not int:
        return None
    if not isinstance(beat.get("doing"), str):
        return None
    return beat
