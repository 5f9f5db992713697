"""Connections to a rank's inbox that closed: a peer that said goodbye, or one cut off.

ZeroMQ reports each closed connection to the inbox (a monitor event) without saying why.
A peer closing its trainer says goodbye on the heartbeats first (runtime/liveness.py); a
peer cut off for a frame over `MessageLimits.max_tensor_bytes` does not. So a closed
connection is warned about only if, GRACE_S later, no goodbye has come to explain it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["ClosedConnections", "GRACE_S"]

GRACE_S = 1.0  # a goodbye and the connection's close travel apart: which comes first varies
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # (per poll)


class ClosedConnections:
    """Counts an inbox's closed connections; warns of those no goodbye explains."""

    def __init__(self, inbox: zmq.Socket, rank: int, warn: Any) -> None:
        self.monitor = inbox.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.rank, self.warn = rank, warn
        self.parted: Callable[[], int] = lambda: 0  # peers that said goodbye (liveness's)
        self._explained = 0  # goodbyes already matched with a closed connection
        self._pending: list[float] = []  # when each unexplained closed connection was seen

    def watch(self, stats: Any) -> None:
        """Take the monitor's events (once per poll); warn of those still unexplained."""
        while self.monitor.get(_EVENTS) & _POLLIN:
            self.monitor.recv_multipart(flags=_NOBLOCK)
            stats.dropped_connections += 1
            self._pending.append(time.monotonic())
        if not self._pending:
            return
        now = time.monotonic()
        matched = min(len(self._pending), self.parted() - self._explained)
        self._explained += matched
        del self._pending[:matched]
        while self._pending and now - self._pending[0] >= GRACE_S:
            self._pending.pop(0)
            self.warn.warning(
                "rank %d: a connection to its inbox closed without its peer saying goodbye "
                "(cut off for a frame over MessageLimits.max_tensor_bytes, or gone)",
                self.rank,
            )

    def close(self, inbox: zmq.Socket) -> None:
        inbox.disable_monitor()
        self.monitor.close(linger=0)
