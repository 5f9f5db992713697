"""ZeroMQ point-to-point transport between ranks.

Each rank binds one PULL inbox (ipc:// on one host, tcp:// across hosts, loopback unless
configured) and publishes its address in the torch.distributed store; it keeps one PUSH
socket per peer it sends to. Sends never block the caller: a message that would exceed
the peer's in-flight byte budget waits in a local queue until the peer returns credits,
so ZeroMQ's message-count high-water mark never decides what is dropped.

On one host (ipc), tensors over `shm_threshold_bytes` travel through a shared-memory
segment per (sender, receiver) pair (`shm.py`): one copy in, none out. On x86-64 the
header and small tensors go through a ring in that segment (`ring.py`) with a doorbell
to wake the receiver (`doorbell.py`), and dead slots come straight back through it;
control messages keep to ZeroMQ, as does everything across hosts. The settings are
`transport_config.py`'s, binding and zero-copy sends `sockets.py`'s, the credits owed
`credits.py`'s and encryption `curve.py`'s; this class runs them.
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
from myelin.runtime import control_ops, doorbell, shm
from myelin.runtime import ring as rings
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
_RING_RETRY_S = 0.0005  # how soon a message waiting for room in a full ring is tried again
_NOBLOCK = int(zmq.NOBLOCK)  # an int: enum flags cost per call
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


@dataclass(slots=True)
class _Peer:
    sock: zmq.Socket
    shm: shm.SendSide | None
    inflight: int = 0  # bytes sent and not yet credited back
    retry: bool = False  # the head of `queue` waits for room the receiver frees in the segment
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
        self._rings = use_shm and self.config.ring_bytes > 0 and rings.SUPPORTED
        max_frames = self.config.limits.max_tensors + 1 if self._rings else 0
        self._shm_in = shm.ReceiveSide(max_frames) if use_shm else None
        self._bell = doorbell.Doorbell(rank, self.config.spin_us) if self._rings else None
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
        if self._bell is not None:
            self._bell.register(self._poller)
        store.set(self._key(rank), self.address)

    def _key(self, rank: int) -> str:  # where `rank` publishes its inbox's address
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
        """Send one message if credits, slots, ring and ZeroMQ allow; False leaves it queued."""
        if peer.inflight and peer.inflight + nbytes > self.config.max_inflight_bytes:
            return False  # wait for credits; a lone oversize message still goes
        side = peer.shm
        wanted = self._rings or nbytes >= self.config.shm_threshold_bytes  # ring, or slots
        if side is not None and side.state == "idle" and wanted and (offer := side.offer()):
            self._send_control(peer, offer)  # inline (over ZeroMQ) until the peer maps it
        taken: list[int] = []
        sent = via_ring = peer.retry = False
        try:
            frames = encode(message, self._placer(peer, nbytes, taken))
            ring = side.ring if side is not None else None
            put = ring.put(frames) if ring is not None else None
            if put is None:  # no ring, or too big for it
                sent = send_frames(peer.sock, frames, self._tracked)
            else:
                sent = via_ring = put
                peer.retry = not put
                if put and ring.asleep():
                    self._bell.ring(side.bell)
        except shm.Wait:
            peer.retry = side.segment.returns is not None  # slots come back without a message
        finally:
            if taken and not sent:
                peer.shm.unplace(taken)
        if sent:
            peer.inflight += nbytes
            self.stats.sent_messages += 1
            self.stats.sent_bytes += nbytes
            self.stats.shm_messages += bool(taken)
            self.stats.ring_messages += via_ring
            self._unseen += nbytes if taken else 0
        return sent

    def _placer(self, peer: _Peer, nbytes: int, taken: list[int]) -> Any:
        """A `place` callback for encode that puts large tensors in the peer's segment."""
        side, threshold = peer.shm, self.config.shm_threshold_bytes
        if side is None or nbytes < threshold or side.state != "ready":
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
            cfg, ring = self.config, self.config.ring_bytes if self._rings else 0
            side = shm.SendSide(cfg.shm_bytes, cfg.shm_wait_s, ring) if self._shm_in else None
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
        bell = self._bell if self._bell is not None and self._bell.readers else None
        spin = bell.spin_s if bell is not None else 0.0
        while not self._arrived and now < deadline:
            if spin and bell.spin(self._inbox, min(deadline, now + spin)):
                self._drain()
            elif bell is None or bell.sleep():
                wake = min(deadline, self._next_wake())
                try:
                    if self._poller.poll(math.ceil(max(wake - now, 0.0) * 1000)):
                        self._drain()
                finally:
                    if bell is not None:
                        bell.wake()
            else:
                self._drain()  # a record came as this rank was going to sleep
            spin = 0.0  # once a poll: a long wait sleeps
            now = time.monotonic()
            self._settle(now)
            self._flush_all()
        self._reap()
        out, self._arrived = self._arrived, []
        return out

    def _next_wake(self) -> float:
        """When poll must look up from waiting: a debt to pay, a slot wait, a full ring."""
        wakes = [p.shm.wait_until for p in self._peers.values() if p.shm and p.shm.wait_until]
        if any(p.retry for p in self._peers.values()):
            wakes.append(time.monotonic() + _RING_RETRY_S)
        return min([*wakes, self._ledger.next_wake()])

    def _drain(self) -> None:
        """Take what waits in the inbox and rings: control acts now, the rest waits for poll."""
        self._unseen = 0
        for peer in self._peers.values():
            if peer.shm is not None:
                peer.shm.take_returns()  # slots the receiver gave back through the segment
        self._drain_inbox()
        if self._bell is not None and self._bell.readers:
            for src, why in self._bell.take(self._accept, self._arrived, _DRAIN_MAX):
                self._ring_broken(src, why)

    def _ring_broken(self, src: int, why: str) -> None:
        """A ring that breaks its rules is read no more; its sender is told to use ZeroMQ."""
        self.stats.rejected += 1
        self._warn.warning("rank %d: stopped reading rank %d's ring: %s", self.rank, src, why)
        token = self._shm_in.token_of(src)
        self._shm_in.drop_ring(src)
        self._bell.readers = self._shm_in.rings()
        self.send_control(src, {"op": "ring_off", "token": token})

    def _drain_inbox(self) -> None:
        inbox = self._inbox
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

    def _accept(self, frames: list, ring_of: int | None = None) -> Message | None:
        """Decode and check one message; `ring_of` is the rank whose ring it came through."""
        fetch = self._fetch if self._shm_in is not None else None
        try:
            msg = decode(frames, self.config.limits, fetch=fetch)
        except MessageError as exc:
            return self._reject(f": {exc}")
        if not 0 <= msg.src < self.world_size or msg.src == self.rank:
            return self._reject(f"from unknown rank {msg.src}")
        if ring_of is not None and msg.src != ring_of:
            return self._reject(f"in rank {ring_of}'s ring, saying it is from rank {msg.src}")
        self.heard_from.add(msg.src)  # a rank connected to this inbox (departures.py)
        if msg.kind == "control" and msg.meta.get("op") in control_ops.OPS:
            control_ops.OPS[msg.meta["op"]](self, msg.src, msg.meta)
            return None
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
        self.stats.received_messages += 1
        self.stats.received_bytes += nbytes
        if nbytes:
            self._ledger.took(msg.src, nbytes)
        return msg

    def _reject(self, why: str) -> None:
        self.stats.rejected += 1
        self._warn.warning("rank %d: rejected a message %s", self.rank, why)

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
                if not self._shm_in.give_back(src, offset):
                    self._ledger.freed(src, offset, nbytes)
        if self._ledger.due(now):
            token_of = self._shm_in.token_of if self._shm_in is not None else _no_token
            self._ledger.pay(self.send_control, token_of)

    def _refuse(self, src: int, op: str, why: str) -> None:
        """Count and log a control message this rank will not act on."""
        self.stats.rejected += 1
        self._warn.warning("rank %d: ignored %s from rank %d: %s", self.rank, op, src, why)

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
        if self._bell is not None:
            self._bell.close()
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




def _no_token(src: int) -> None:
    return None
