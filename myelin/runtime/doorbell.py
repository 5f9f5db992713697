"""The rings a rank reads (runtime/ring.py), its doorbell, and how it waits on both.

A rank that reads rings binds one datagram socket in Linux's abstract namespace (no file
to leave behind) and gives its name to each sender with the segment's `shm_ready`. About
to sleep, the rank checks its rings for `spin_us` first (a message within that costs no
wake-up), then marks every ring "asleep" and sleeps on the doorbell as well as its
inbox; a sender rings only a ring marked asleep (ring.py says why none is lost).
Datagrams carry nothing: the rings hold the messages, so a full doorbell drops wake-ups
that are already waiting.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from myelin.runtime.messages import COPY_BELOW
from myelin.runtime.ring import Reader, RingError

__all__ = ["PREFIX", "Doorbell", "is_bell"]

PREFIX = "myelin-bell-"
_DRAIN_MAX = 1024
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def is_bell(name: Any) -> bool:
    """Whether `name` is a doorbell's name as `Doorbell` makes them."""
    return isinstance(name, str) and name.startswith(PREFIX) and len(name) < 100


def address(name: str) -> bytes:
    """The socket address of the doorbell called `name`."""
    return b"\0" + name.encode()


class Doorbell:
    """One rank's doorbell and the rings it reads: `readers` is (src, Reader) pairs."""

    def __init__(self, rank: int, spin_us: float) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{rank}-{uuid.uuid4().hex[:8]}"
        self.readers: list[tuple[int, Reader]] = []
        self.spin_s = spin_us * 1e-6
        self._sock, self._out = _datagram_socket(), _datagram_socket()
        self._sock.bind(address(self.name))

    def register(self, poller: zmq.Poller) -> None:
        """Make `poller` wake on a ring of the doorbell too."""
        poller.register(self._sock, zmq.POLLIN)

    def ring(self, bell: bytes) -> None:
        """Wake the rank whose doorbell is at `bell`; a full doorbell has wake-ups waiting
        already, and a peer gone is for the heartbeats to find."""
        try:
            self._out.sendto(b"\0", bell)
        except OSError:
            pass

    def spin(self, inbox: zmq.Socket, until: float) -> bool:
        """Check the rings (and now and then the inbox) until `until`; True once one has
        something to take."""
        readers = [reader for _, reader in self.readers]
        clock, looks = time.monotonic, 0
        while True:
            for reader in readers:
                if reader.ready():
                    return True
            looks += 1
            if looks % 16 == 0 and inbox.get(_EVENTS) & _POLLIN:
                return True
            if clock() >= until:
                return False

    def take(
        self, accept: Callable[..., Any], arrived: list, most: int
    ) -> list[tuple[int, str]]:
        """Decode what the rings hold (`accept(frames, ring_of=src)`, at most `most` a
        ring) onto `arrived`; returns (src, why) for each ring that broke its rules."""
        broken = []
        for src, reader in self.readers:
            for _ in range(most):
                try:
                    frames = reader.take()
                except RingError as exc:
                    broken.append((src, str(exc)))
                    break
                if frames is None:
                    break
                # decode copies frames under COPY_BELOW; a larger one must not alias the ring
                frames = [f if f.nbytes < COPY_BELOW else bytearray(f) for f in frames]
                try:
                    msg = accept(frames, ring_of=src)
                finally:
                    del frames
                    reader.advance()
                if msg is not None:
                    arrived.append(msg)
        return broken

    def sleep(self) -> bool:
        """Mark every ring asleep (senders ring from now on); False, with none marked, if a
        record came meanwhile."""
        for i, (_, reader) in enumerate(self.readers):
            if not reader.sleep():
                for _, earlier in self.readers[:i]:
                    earlier.wake()
                return False
        return True

    def wake(self) -> None:
        """Mark every ring awake (senders need not ring), and empty the doorbell."""
        for _, reader in self.readers:
            reader.wake()
        for _ in range(_DRAIN_MAX):
            try:
                self._sock.recv(64)
            except OSError:
                return

    def close(self) -> None:
        self.readers = []
        self._sock.close()
        self._out.close()


def _datagram_socket() -> socket.socket:
    kind = socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
    return socket.socket(socket.AF_UNIX, kind)
