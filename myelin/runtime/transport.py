"""ZeroMQ point-to-point transport between ranks.

Each rank binds one PULL inbox (ipc:// on one host, tcp:// across hosts, loopback
unless configured) and publishes its address in the torch.distributed store; it
keeps one PUSH socket per peer it sends to. Sends never block the caller: a
message that would exceed the peer's in-flight byte budget waits in a local
queue until the peer returns credits, so ZeroMQ's message-count high-water mark
never decides what is dropped.

On one host (ipc), tensors over `shm_threshold_bytes` travel through a shared-memory
segment per (sender, receiver) pair (see `shm.py`): one copy in, none out, and only
the header goes over ZeroMQ. Credits and freed slots flow back as control messages.
The settings are `transport_config.py`'s, binding and zero-copy sends `sockets.py`'s,
the credits owed `credits.py`'s and encryption `curve.py`'s; this class runs them.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import zmq

from myelin.errors import DeadlineError, MessageError
from myelin.runtime import shm
from myelin.runtime.credits import Ledger
from myelin.runtime.curve import Curve
from myelin.runtime.departures import ClosedConnections
from myelin.runtime.logs import Throttled
from myelin.runtime.messages import Message, decode, encode
from myelin.runtime.sockets import bind, send_frames
from myelin.runtime.transport_config import TransportConfig, TransportStats

__all__ = ["TransportConfig", "TransportStats", "Transport"]

log = logging.getLogger(__name__)

_LOOK_EVERY = 2 * 2**20  # bytes sent through shared memory between looks for returned slots
_DRAIN_MAX = 1024  # messages taken from the inbox per look, so a flood cannot starve the loop
_NOBLOCK = int(zmq.NOBLOCK)  # an int: enum flags cost per call
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


@dataclass(slots=True)
class _Peer:
    sock: zmq.Socket
    shm: shm.SendSide | None
    inflight: int = 0  # bytes sent and not yet credited back
    queue: deque = field(default_factory=deque)  # (message, nbytes) waiting to leave


class Transport:
    """One rank's inbox and outboxes. Not thread-safe: the event loop owns it."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        config: TransportConfig | None = None,
        prefix: str = "myelin",
        same_host: bool = True,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config or TransportConfig()
        self.stats = TransportStats()
        self._warn = Throttled(log)  # rejections: a flood must not flood the log
        self._store = store
        self._prefix = prefix
        self._ctx = zmq.Context()
        self._peers: dict[int, _Peer] = {}
        self._tracked: list[tuple[zmq.MessageTracker, Any]] = []  # buffers alive until sent
        self._arrived: list[Message] = []  # taken from the inbox, not yet returned by poll
        self._unseen = 0  # bytes sent through shared memory since the inbox was last looked at
        self._ledger = Ledger(self.config.max_inflight_bytes, self.config.shm_bytes)
        self._ipc_paths: list[str] = []  # socket files to remove at close
        kind = self.config.kind
        if kind == "auto":
            kind = "ipc" if same_host else "tcp"
        self.kind = kind
        use_shm = self.config.shm and kind == "ipc" and shm.SUPPORTED
        self._shm_in = shm.ReceiveSide() if use_shm else None
        self.curve = self.config.wants_curve(kind)
        self._curve: Curve | None = None
        if self.curve:
            timeout = self.config.connect_timeout_s
            self._curve = Curve(self._ctx, store, prefix, rank, world_size, timeout)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 100_000)
        limits = self.config.limits  # a bigger frame drops the sender's connection
        frame_max = max(limits.max_tensor_bytes, limits.max_header_bytes)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, frame_max)
        self.secure_server(self._inbox)
        self.closed = ClosedConnections(self._inbox, rank, self._warn)
        self.heard_from: set[int] = set()  # ranks whose messages this inbox accepted
        self.address = self.bind_like(self._inbox, "")
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        store.set(self._key(rank), self.address)

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/addr/{rank}"

    # -- sockets and security ------------------------------------------------

    @property
    def context(self) -> zmq.Context:
        """The ZeroMQ context (thread-safe; its sockets are not), with CURVE's authenticator."""
        return self._ctx

    def secure_server(self, sock: zmq.Socket) -> None:
        """Make a socket that binds accept only CURVE clients holding a rank's key."""
        if self._curve is not None:
            self._curve.server(sock)

    def secure_client(self, sock: zmq.Socket, rank: int) -> None:
        """Make a socket that connects to `rank` speak CURVE with this rank's keys."""
        if self._curve is not None:
            self._curve.client(sock, rank)

    def bind_like(self, sock: zmq.Socket, tag: str) -> str:
        """Bind `sock` the way this rank's inbox is bound (ipc or tcp); returns its address."""
        cfg = self.config
        address, path = bind(sock, self.kind, cfg.host, cfg.ipc_dir, f"{self.rank}{tag}")
        if path is not None:
            self._ipc_paths.append(path)
        return address

    # -- sending -------------------------------------------------------------

    def send(self, dst: int, message: Message) -> None:
        """Queue a message for `dst`; it leaves now if the peer has credit, later otherwise."""
        if not 0 <= dst < self.world_size or dst == self.rank:
            raise ValueError(
                f"rank {self.rank} cannot send to rank {dst} (world {self.world_size})"
            )
        peer = self._peers.get(dst) or self._peer(dst)
        nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
        drained = nbytes >= self.config.shm_threshold_bytes and (
            peer.queue or self._unseen >= _LOOK_EVERY
        )
        if drained:
            self._drain()  # slots that came back are reused while still warm in cache
        if not peer.queue and self._try_send(peer, message, nbytes):
            return
        if not drained:
            self._drain()  # credits that came back may let it leave now
            if not peer.queue and self._try_send(peer, message, nbytes):
                return
        encode(message)  # validate now, so a bad message fails in the caller, not later
        peer.queue.append((message, nbytes))
        self.stats.queued_for_credits += 1

    def _try_send(self, peer: _Peer, message: Message, nbytes: int) -> bool:
        """Send one message if credits, a slot and ZeroMQ allow; False leaves it queued."""
        if peer.inflight and peer.inflight + nbytes > self.config.max_inflight_bytes:
            return False  # wait for credits; a lone oversize message still goes
        taken: list[int] = []
        sent = False
        try:
            frames = encode(message, self._placer(peer, nbytes, taken))
            sent = send_frames(peer.sock, frames, self._tracked)
        except shm.Wait:
            pass
        finally:
            if taken and not sent:
                peer.shm.unplace(taken)
        if sent:
            peer.inflight += nbytes
            self.stats.sent_messages += 1
            self.stats.sent_bytes += nbytes
            self.stats.shm_messages += bool(taken)
            self._unseen += nbytes if taken else 0
        return sent

    def _placer(self, peer: _Peer, nbytes: int, taken: list[int]) -> Any:
        """A `place` callback for encode that puts large tensors in the peer's segment."""
        side, threshold = peer.shm, self.config.shm_threshold_bytes
        if side is None or nbytes < threshold or side.state == "off":
            return None
        if side.state == "idle" and (offer := side.offer()):
            self._send_control(peer, offer)  # inline until the peer has mapped it
        if side.state != "ready":
            return None

        def place(i: int, t: torch.Tensor) -> list[int] | None:
            if t.numel() * t.element_size() < threshold:
                return None
            loc = side.place(t, peer.inflight)
            if loc is None:
                self.stats.shm_fallbacks += 1
            else:
                taken.append(loc[1])
            return loc

        return place

    def _send_control(self, peer: _Peer, meta: dict[str, Any]) -> None:
        """Control messages bypass credits: they are tiny and must never wait."""
        frames = encode(Message("control", self.rank, 0, 0, 0, [], meta))
        try:
            peer.sock.send(frames[0], flags=_NOBLOCK)
        except zmq.Again:
            log.warning("rank %d: control message %s dropped (queue full)", self.rank, meta)

    def _flush(self, peer: _Peer) -> None:
        while peer.queue:
            message, nbytes = peer.queue[0]
            if not self._try_send(peer, message, nbytes):
                return
            peer.queue.popleft()

    def shm_committed_bytes(self) -> int:
        """Memory committed in the shared segments this rank sends through."""
        sides = [p.shm for p in self._peers.values() if p.shm is not None]
        return sum(side.segment.committed for side in sides if side.segment is not None)

    def pending_sends(self) -> int:
        """Messages not yet handed to ZeroMQ, plus zero-copy frames ZeroMQ still reads."""
        self._reap()
        return sum(len(p.queue) for p in self._peers.values()) + len(self._tracked)

    def _reap(self) -> None:
        if self._tracked:
            self._tracked = [(t, b) for t, b in self._tracked if not t.done]

    def _peer(self, dst: int) -> _Peer:
        peer = self._peers.get(dst)
        if peer is None:
            address = self._lookup(dst)
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, self.config.linger_ms)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            self.secure_client(sock, dst)
            sock.connect(address)
            side = None
            if self._shm_in is not None:
                side = shm.SendSide(self.config.shm_bytes, self.config.shm_wait_s)
            peer = self._peers[dst] = _Peer(sock, side)
        return peer

    def _lookup(self, rank: int) -> str:
        key = self._key(rank)
        try:
            self._store.wait([key], timedelta(seconds=self.config.connect_timeout_s))
        except Exception as exc:
            raise DeadlineError(
                f"rank {self.rank}: rank {rank} did not publish its address ({key}) within "
                f"{self.config.connect_timeout_s:.0f}s; is it running?"
            ) from exc
        return self._store.get(key).decode()

    def connect(self, ranks: list[int]) -> None:
        """Open connections to `ranks` now rather than on first send."""
        for r in ranks:
            if r != self.rank:
                self._peer(r)

    # -- receiving -----------------------------------------------------------

    def poll(self, timeout_s: float) -> list[Message]:
        """Return the messages that arrived within `timeout_s` (all that are waiting)."""
        now = time.monotonic()
        deadline = now + max(timeout_s, 0.0)
        self._settle(now)
        self.closed.watch(self.stats)
        self._drain()
        self._flush_all()  # queued messages whose slot wait has timed out go inline now
        while not self._arrived and now < deadline:
            wake = min(deadline, self._next_wake())
            if self._poller.poll(math.ceil(max(wake - now, 0.0) * 1000)):
                self._drain()
            now = time.monotonic()
            self._settle(now)
            self._flush_all()
        self._reap()
        out, self._arrived = self._arrived, []
        return out

    def _next_wake(self) -> float:
        """The earliest time poll must look up from waiting: a debt to pay or a slot wait."""
        wakes = [p.shm.wait_until for p in self._peers.values() if p.shm and p.shm.wait_until]
        return min([*wakes, self._ledger.next_wake()])

    def _drain(self) -> None:
        """Take what waits in the inbox: control messages act now, the rest wait for poll."""
        inbox = self._inbox
        self._unseen = 0
        for _ in range(_DRAIN_MAX):
            if not inbox.get(_EVENTS) & _POLLIN:
                return
            try:
                frames = [inbox.recv(_NOBLOCK, copy=False)]
            except zmq.Again:  # POLLIN can be set before a (CURVE) message is complete
                return
            while frames[-1].more:  # the rest of a multipart message is already here
                frames.append(inbox.recv(_NOBLOCK, copy=False))
            msg = self._accept(frames)
            if msg is not None:
                self._arrived.append(msg)

    def _flush_all(self) -> None:
        for peer in self._peers.values():
            if peer.queue:
                self._flush(peer)

    def _accept(self, frames: list) -> Message | None:
        fetch = self._fetch if self._shm_in is not None else None
        try:
            msg = decode(frames, self.config.limits, fetch=fetch)
        except MessageError as exc:
            self.stats.rejected += 1
            self._warn.warning("rank %d: rejected a message: %s", self.rank, exc)
            return None
        if not 0 <= msg.src < self.world_size or msg.src == self.rank:
            self.stats.rejected += 1
            self._warn.warning(
                "rank %d: rejected a message from unknown rank %d", self.rank, msg.src
            )
            return None
        self.heard_from.add(msg.src)  # a rank connected to this inbox (departures.py)
        if msg.kind == "control" and msg.meta.get("op") in _CONTROL_OPS:
            _CONTROL_OPS[msg.meta["op"]](self, msg.src, msg.meta)
            return None
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
        self.stats.received_messages += 1
        self.stats.received_bytes += nbytes
        if nbytes:
            self._ledger.took(msg.src, nbytes)
        return msg

    def _fetch(
        self, src: int, loc: list[int], dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
    ) -> torch.Tensor:
        """Wrap a slot of `src`'s segment as a tensor; the slot goes back when it dies."""
        try:
            return self._shm_in.tensor(src, loc, dtype, shape, nbytes)
        except ValueError as exc:
            raise MessageError("tensors.shm", str(exc)) from None

    def _settle(self, now: float) -> None:
        """Pay what this rank owes its senders (credits, freed slots) when it is due."""
        if self._shm_in is not None:
            for src, offset, nbytes in self._shm_in.released():
                self._ledger.freed(src, offset, nbytes)
        if self._ledger.due(now):
            token_of = self._shm_in.token_of if self._shm_in is not None else _no_token
            self._ledger.pay(self.send_control, token_of)

    def _refuse(self, src: int, op: str, why: str) -> None:
        """Count and log a control message this rank will not act on."""
        self.stats.rejected += 1
        self._warn.warning("rank %d: ignored %s from rank %d: %s", self.rank, op, src, why)

    def _on_credit(self, src: int, meta: dict[str, Any]) -> None:
        peer = self._peers.get(src)
        amount, free = meta.get("bytes"), meta.get("free", [])
        if peer is None or type(amount) is not int or amount < 0 or not isinstance(free, list):
            return self._refuse(src, "credit", f"malformed: bytes={amount!r}")
        if amount > peer.inflight:  # more than was sent: not from the real receiver
            return self._refuse(src, "credit", f"{amount} bytes, but {peer.inflight} in flight")
        peer.inflight -= amount
        if free:
            if peer.shm is None or not peer.shm.owns(meta.get("token")):
                return self._refuse(src, "credit", "slots freed without the segment's token")
            bad = peer.shm.free(free)
            if bad:
                self._refuse(src, "credit", f"{bad} freed slots that are not in use")
        self._flush(peer)
        return None

    def _on_offer(self, src: int, meta: dict[str, Any]) -> None:
        if self._shm_in is None:
            reply = {"op": "shm_refused", "reason": "shared memory is off here"}
        elif self._shm_in.token_of(src) is not None:  # one segment per sender, for life
            return self._refuse(src, "shm_offer", "a segment from this rank is mapped already")
        else:
            reply = self._shm_in.accept(src, meta)
        self._send_control(self._peer(src), reply)
        return None

    def _on_ready(self, src: int, meta: dict[str, Any]) -> None:
        peer = self._peers.get(src)
        if peer is None or peer.shm is None or not peer.shm.ready(meta.get("token")):
            return self._refuse(src, "shm_ready", "no offer with that token")
        self._flush(peer)
        return None

    def _on_refused(self, src: int, meta: dict[str, Any]) -> None:
        peer = self._peers.get(src)
        if peer is None or peer.shm is None or peer.shm.state != "offered":
            return self._refuse(src, "shm_refused", "no offer was pending")
        peer.shm.refused(meta.get("reason"))
        return None

    def send_control(self, dst: int, meta: dict[str, Any]) -> None:
        """Send a small control message (abort, shutdown...) that skips the credit queue."""
        self._send_control(self._peer(dst), meta)

    # -- shutdown ------------------------------------------------------------

    def close(self) -> None:
        """Close every socket with a finite linger and drop shared memory, so nothing is left."""
        if self._ctx.closed:
            return
        for peer in self._peers.values():
            peer.sock.close(linger=self.config.linger_ms)
            if peer.shm is not None:
                peer.shm.close()
        if self._shm_in is not None:
            self._shm_in.close()
        self._tracked.clear()
        self.closed.close(self._inbox)
        self._inbox.close(linger=0)
        if self._curve is not None:
            self._curve.stop()
        self._ctx.destroy(linger=0)  # closes any socket still open, so this never blocks
        for path in self._ipc_paths:
            if os.path.exists(path):
                os.unlink(path)


_CONTROL_OPS = {
    "credit": Transport._on_credit,
    "shm_offer": Transport._on_offer,
    "shm_ready": Transport._on_ready,
    "shm_refused": Transport._on_refused,
}


def _no_token(src: int) -> None:
    return None
