"""ZeroMQ CURVE for one rank's sockets: encrypted, and open only to the job's own ranks.

Each rank makes a key pair per run and publishes the public half in the torch.distributed
store. A socket that binds is a CURVE server whose ZAP handler admits only clients whose
key some rank published; a socket that connects to a rank speaks CURVE with this rank's
keys and checks the server's. So a process without the keys cannot connect. (The store
itself is not authenticated: keep its port reachable only by the job.)
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["Curve", "admit_keys"]

log = logging.getLogger(__name__)


class Curve:
    """This rank's key pair, published, and the authenticator that admits only ranks' keys."""

    def __init__(
        self,
        ctx: zmq.Context,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self._store = store
        self._prefix = prefix
        self._timeout = timedelta(seconds=timeout_s)
        self._public, self._secret = zmq.curve_keypair()
        store.set(f"{prefix}/curve/{rank}", self._public)
        self._auth = ThreadAuthenticator(ctx, log=log)
        self._auth.start()
        self._auth.configure_curve_callback("*", _RankKeys(store, prefix, rank, world_size))

    def public_key(self, rank: int) -> bytes:
        """`rank`'s CURVE public key, from the store."""
        key = f"{self._prefix}/curve/{rank}"
        self._store.wait([key], self._timeout)
        return self._store.get(key)

    def server(self, sock: zmq.Socket) -> None:
        """Make a socket that binds accept only CURVE clients holding a rank's key."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self._public
        sock.curve_server = True

    def client(self, sock: zmq.Socket, rank: int) -> None:
        """Make a socket that connects to `rank` speak CURVE with this rank's keys."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self._public
        sock.curve_serverkey = self.public_key(rank)

    def stop(self) -> None:
        """Stop the authenticator's thread."""
        self._auth.stop()


class _RankKeys:
    """CURVE's admission check: a client is let in only with a key some rank published."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int) -> None:
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._known: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key not in self._known:
            for r in range(self._world_size):
                name = f"{self._prefix}/curve/{r}"
                if self._store.check([name]):
                    self._known.add(self._store.get(name))
        if key in self._known:
            return True
        log.warning("rank %d: refused a connection with an unknown CURVE key", self._rank)
        return False


def admit_keys(ctx: zmq.Context, keys: list[bytes], who: str) -> ThreadAuthenticator:
    """An authenticator on `ctx` that lets CURVE clients in only with one of `keys` (for a
    process outside the world, such as the hub, told its clients' keys when started)."""
    auth = ThreadAuthenticator(ctx, log=log)
    auth.start()
    auth.configure_curve_callback("*", _Known(set(keys), who))
    return auth


class _Known:
    """CURVE's admission check against a fixed set of public keys."""

    def __init__(self, keys: set[bytes], who: str) -> None:
        self._keys = keys
        self._who = who

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._keys:
            return True
        log.warning("%s: refused a connection with an unknown CURVE key", self._who)
        return False
