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
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import re
import socket
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import zmq

from myelin.errors import ConfigError, DeadlineError, MessageError
from myelin.runtime import shm
from myelin.runtime.logs import Throttled
from myelin.runtime.messages import Message, MessageLimits, decode, encode

__all__ = ["TransportConfig", "TransportStats", "Transport"]

log = logging.getLogger(__name__)

_IPC_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
_KINDS = ("auto", "ipc", "tcp")
_DRAIN_MAX = 1024  # messages taken from the inbox per look, so a flood cannot starve the loop
_FREE_CHUNK = 4096  # freed slots per control message, well under the header limit
_SETTLE_DELAY_S = 0.001  # how long small credits and freed slots may wait to be batched
_SLOTS_BATCH = 4 * 2**20  # freed slot bytes that go back at once, aged or not
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)  # ints: enum flags cost per call
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportConfig:
    """How ranks talk to each other.

    kind: "ipc" (one host), "tcp" (any hosts) or "auto" (ipc when all ranks share a host).
    host: the address tcp binds to; loopback unless you set it, on purpose.
    max_inflight_bytes: bytes sent to one peer and not yet taken by it (credit budget).
    linger_ms: how long close() lets unsent messages drain before dropping them.
    connect_timeout_s: how long to wait for a peer to publish its address.
    ipc_dir: directory for ipc socket files; None uses Linux's abstract socket namespace
        (no file, gone with the process), or the temp directory elsewhere.
    shm: carry large tensors between ranks on one host (ipc) through shared memory.
    shm_threshold_bytes: tensors of at least this many bytes take shared memory.
    shm_bytes: size of each (sender, receiver) segment, committed in RAM at the first
        large send; a tensor that does not fit travels inline.
    shm_wait_s: how long a message may wait for a free slot, once nothing is in flight,
        before it goes inline instead (a receiver holding every slot cannot stall a sender).
    curve: encrypt and authenticate every connection with ZeroMQ CURVE, with keys made
        per run and exchanged through the torch.distributed store, so a process without
        them cannot connect. None (default): on when tcp binds beyond loopback.
    heartbeat_s: how often each rank tells every other rank it is alive.
    peer_timeout_s: a peer silent this long is lost (a dead process on this host is seen
        at once); every rank then raises myelin.PeerLostError.
    exit_after_loss_s: after a loss, a rank whose main thread has not stopped by then (it
        is stuck in a collective, say) exits with status 1; None never forces an exit.
    """

    kind: str = "auto"
    host: str = "127.0.0.1"
    max_inflight_bytes: int = 256 * 2**20
    linger_ms: int = 1000
    connect_timeout_s: float = 60.0
    ipc_dir: str | None = None
    limits: MessageLimits = field(default_factory=MessageLimits)
    shm: bool = True
    shm_threshold_bytes: int = 64 * 2**10
    shm_bytes: int = 256 * 2**20
    shm_wait_s: float = 0.05
    curve: bool | None = None
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 5.0
    exit_after_loss_s: float | None = 5.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"TransportConfig.kind={self.kind!r} must be one of {_KINDS}")
        if not isinstance(self.host, str) or not _is_address(self.host):
            raise ConfigError(
                f"TransportConfig.host={self.host!r} must be an IP address or a host name"
            )
        _check_int("max_inflight_bytes", self.max_inflight_bytes, 1, 2**62)
        _check_int("linger_ms", self.linger_ms, 0, 600_000)
        _check_number("connect_timeout_s", self.connect_timeout_s, 1e-3, 86_400.0)
        if self.ipc_dir is not None and (not isinstance(self.ipc_dir, str) or not self.ipc_dir):
            raise ConfigError(f"TransportConfig.ipc_dir={self.ipc_dir!r} must be None or a path")
        if self.ipc_dir is not None and not os.path.isdir(self.ipc_dir):
            raise ConfigError(f"TransportConfig.ipc_dir={self.ipc_dir!r} is not a directory")
        if not isinstance(self.limits, MessageLimits):
            raise ConfigError(f"TransportConfig.limits={self.limits!r} must be a MessageLimits")
        if type(self.shm) is not bool:
            raise ConfigError(f"TransportConfig.shm={self.shm!r} must be True or False")
        _check_int("shm_threshold_bytes", self.shm_threshold_bytes, 1, 2**40)
        _check_int("shm_bytes", self.shm_bytes, 2**20, 2**40)
        _check_number("shm_wait_s", self.shm_wait_s, 0.0, 60.0)
        if self.curve is not None and type(self.curve) is not bool:
            raise ConfigError(f"TransportConfig.curve={self.curve!r} must be None, True or False")
        if self.curve and not zmq.has("curve"):
            raise ConfigError("TransportConfig.curve=True, but this pyzmq has no CURVE support")
        _check_number("heartbeat_s", self.heartbeat_s, 0.01, 60.0)
        _check_number("peer_timeout_s", self.peer_timeout_s, 0.05, 3600.0)
        if self.peer_timeout_s < 2 * self.heartbeat_s:
            raise ConfigError(
                f"TransportConfig.peer_timeout_s={self.peer_timeout_s!r} must be at least twice "
                f"heartbeat_s={self.heartbeat_s!r}"
            )
        if self.exit_after_loss_s is not None:
            _check_number("exit_after_loss_s", self.exit_after_loss_s, 0.0, 3600.0)

    def wants_curve(self, kind: str) -> bool:
        """Whether connections are encrypted: as set, or when tcp binds beyond loopback."""
        if self.curve is not None:
            return self.curve
        wanted = kind == "tcp" and not _is_loopback(self.host)
        if wanted and not zmq.has("curve"):
            log.warning(
                "TransportConfig.curve: tcp binds %s, beyond loopback, but this pyzmq has no "
                "CURVE support; connections are not encrypted",
                self.host,
            )
            return False
        return wanted


def _is_address(host: str) -> bool:
    """An IP literal, or a host name as RFC 1123 spells one."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return 0 < len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise ConfigError(f"TransportConfig.{name}={value!r} must be an int in [{low}, {high}]")


def _check_number(name: str, value: Any, low: float, high: float) -> None:
    if type(value) not in (int, float) or not low <= value <= high:
        raise ConfigError(f"TransportConfig.{name}={value!r} must be a number in [{low}, {high}]")


@dataclass(slots=True)
class TransportStats:
    """Counters a rank keeps about its own traffic."""

    sent_messages: int = 0
    sent_bytes: int = 0
    received_messages: int = 0
    received_bytes: int = 0
    rejected: int = 0
    queued_for_credits: int = 0
    shm_messages: int = 0  # messages sent with at least one tensor in shared memory
    shm_fallbacks: int = 0  # large tensors sent inline because no slot was free
    dropped_connections: int = 0  # inbox connections that closed: a peer left, or ZeroMQ
    # cut off one that sent a frame over MessageLimits (ZMQ_MAXMSGSIZE)


@dataclass(slots=True)
class _Peer:
    sock: zmq.Socket
    shm: shm.SendSide | None
    inflight: int = 0  # bytes sent and not yet credited back
    queue: deque = field(default_factory=deque)  # (message, nbytes) waiting to leave


@dataclass(slots=True)
class _Debt:
    """What this rank owes one sender: credits for bytes taken, and slots freed."""

    credit: int = 0
    slots: list[int] = field(default_factory=list)
    slot_bytes: int = 0


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
        self._debts: dict[int, _Debt] = {}
        self._debt_since: float | None = None  # when the oldest unpaid debt arose
        self._ipc_path: str | None = None
        self._extra_paths: list[str] = []  # ipc files of sockets bound with bind_like
        kind = self.config.kind
        if kind == "auto":
            kind = "ipc" if same_host else "tcp"
        self.kind = kind
        use_shm = self.config.shm and kind == "ipc" and shm.SUPPORTED
        self._shm_in = shm.ReceiveSide() if use_shm else None
        self.curve = self.config.wants_curve(kind)
        self._auth = None
        if self.curve:
            self._start_curve()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 100_000)
        limits = self.config.limits  # a bigger frame drops the sender's connection
        frame_max = max(limits.max_tensor_bytes, limits.max_header_bytes)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, frame_max)
        self.secure_server(self._inbox)
        self._monitor = self._inbox.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.address = self._bind(kind)
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        store.set(self._key(rank), self.address)

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/addr/{rank}"

    # -- security ------------------------------------------------------------

    @property
    def context(self) -> zmq.Context:
        """The ZeroMQ context (thread-safe; its sockets are not), with CURVE's authenticator."""
        return self._ctx

    def _start_curve(self) -> None:
        """Make this rank's key pair, publish the public half, and admit only ranks' keys."""
        from zmq.auth.thread import ThreadAuthenticator

        self._public, self._secret = zmq.curve_keypair()
        self._store.set(f"{self._prefix}/curve/{self.rank}", self._public)
        self._auth = ThreadAuthenticator(self._ctx, log=log)
        self._auth.start()
        self._auth.configure_curve_callback("*", _RankKeys(self))

    def public_key(self, rank: int) -> bytes:
        """`rank`'s CURVE public key, from the store."""
        key = f"{self._prefix}/curve/{rank}"
        timeout = timedelta(seconds=self.config.connect_timeout_s)
        self._store.wait([key], timeout)
        return self._store.get(key)

    def secure_server(self, sock: zmq.Socket) -> None:
        """Make a socket that binds accept only CURVE clients holding a rank's key."""
        if self.curve:
            sock.curve_secretkey = self._secret
            sock.curve_publickey = self._public
            sock.curve_server = True

    def secure_client(self, sock: zmq.Socket, rank: int) -> None:
        """Make a socket that connects to `rank` speak CURVE with this rank's keys."""
        if self.curve:
            sock.curve_secretkey = self._secret
            sock.curve_publickey = self._public
            sock.curve_serverkey = self.public_key(rank)

    def _bind(self, kind: str) -> str:
        return self.bind_like(self._inbox, "")

    def bind_like(self, sock: zmq.Socket, tag: str) -> str:
        """Bind `sock` the way this rank's inbox is bound (ipc or tcp); returns its address."""
        kind = self.kind
        if kind == "tcp":
            sock.bind(f"tcp://{_bracket(self.config.host)}:0")
            return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        name = f"myelin-{os.getpid()}-{self.rank}{tag}-{uuid.uuid4().hex[:8]}.sock"
        if self.config.ipc_dir is None and sys.platform == "linux":
            address = f"ipc://@{name}"  # abstract namespace: no file to leave behind
            sock.bind(address)
            return address
        path = os.path.join(self.config.ipc_dir or tempfile.gettempdir(), name)
        if len(path.encode()) > _IPC_PATH_MAX:
            log.warning("ipc path %r is over %d bytes; binding in /tmp", path, _IPC_PATH_MAX)
            path = os.path.join("/tmp", name)
        if len(path.encode()) > _IPC_PATH_MAX:
            raise ConfigError(
                f"ipc socket path {path!r} is {len(path.encode())} bytes, over Linux's "
                f"{_IPC_PATH_MAX}; set TransportConfig.ipc_dir to a shorter directory"
            )
        sock.bind(f"ipc://{path}")
        if sock is self._inbox:
            self._ipc_path = path
        else:
            self._extra_paths.append(path)
        return f"ipc://{path}"

    # -- sending -------------------------------------------------------------

    def send(self, dst: int, message: Message) -> None:
        """Queue a message for `dst`; it leaves now if the peer has credit, later otherwise."""
        if not 0 <= dst < self.world_size or dst == self.rank:
            raise ValueError(
                f"rank {self.rank} cannot send to rank {dst} (world {self.world_size})"
            )
        peer = self._peer(dst)
        self._drain()  # take credits and slots that came back, so this message can use them
        nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
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
            sent = self._send_frames(peer.sock, frames)
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

    def _send_frames(self, sock: zmq.Socket, frames: list) -> bool:
        last = len(frames) - 1
        try:
            sock.send(frames[0], flags=_NOBLOCK | (_SNDMORE if last else 0))
        except zmq.Again:
            return False
        for i in range(1, last + 1):
            more = _SNDMORE if i < last else 0
            # pyzmq tracks only the frame it was given, so track each large frame on
            # its own; small frames are copied by pyzmq and report done at once.
            if len(frames[i]) < zmq.COPY_THRESHOLD:
                sock.send(frames[i], flags=more)
                continue
            tracker = sock.send(frames[i], flags=more, copy=False, track=True)
            if not tracker.done:
                self._tracked.append((tracker, frames[i]))
        return True

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
        if self._debt_since is not None:
            wakes.append(self._debt_since + _SETTLE_DELAY_S)
        return min(wakes, default=math.inf)

    def _drain(self) -> None:
        """Take what waits in the inbox: control messages act now, the rest wait for poll."""
        while self._monitor.getsockopt(_EVENTS) & _POLLIN:
            self._monitor.recv_multipart(flags=_NOBLOCK)  # an event: a connection closed
            self.stats.dropped_connections += 1
            self._warn.warning(
                "rank %d: a connection to its inbox closed (a peer left, or sent a frame over "
                "MessageLimits.max_tensor_bytes and was cut off)",
                self.rank,
            )
        for _ in range(_DRAIN_MAX):
            if not self._inbox.getsockopt(_EVENTS) & _POLLIN:
                return
            try:
                frames = self._inbox.recv_multipart(flags=_NOBLOCK, copy=False)
            except zmq.Again:  # POLLIN can be set before a (CURVE) message is complete
                return
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
        if msg.kind == "control" and msg.meta.get("op") in _CONTROL_OPS:
            _CONTROL_OPS[msg.meta["op"]](self, msg.src, msg.meta)
            return None
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
        self.stats.received_messages += 1
        self.stats.received_bytes += nbytes
        if nbytes:
            self._debt(msg.src).credit += nbytes
        return msg

    def _fetch(
        self, src: int, loc: list[int], dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
    ) -> torch.Tensor:
        """Wrap a slot of `src`'s segment as a tensor; the slot goes back when it dies."""
        try:
            return self._shm_in.tensor(src, loc, dtype, shape, nbytes)
        except ValueError as exc:
            raise MessageError("tensors.shm", str(exc)) from None

    def _debt(self, src: int) -> _Debt:
        if self._debt_since is None:
            self._debt_since = time.monotonic()
        debt = self._debts.get(src)
        if debt is None:
            debt = self._debts[src] = _Debt()
        return debt

    def _settle(self, now: float) -> None:
        """Pay credits and return freed slots, batched: when a debt is large or has aged.

        Batching keeps control traffic to about one message per peer per millisecond; a
        large debt (an eighth of the credit budget, 4 MiB of slots) is paid at once, so a
        sender never starves and reuses slots while they are still in its cache.
        """
        if self._shm_in is not None:
            for src, offset, nbytes in self._shm_in.released():
                debt = self._debt(src)
                debt.slots.append(offset)
                debt.slot_bytes += nbytes
        if self._debt_since is None:
            return
        big_credit = self.config.max_inflight_bytes // 8
        big_slots = min(self.config.shm_bytes // 8, _SLOTS_BATCH)  # slots reused warm in cache
        if now - self._debt_since < _SETTLE_DELAY_S and not any(
            d.credit >= big_credit or d.slot_bytes >= big_slots for d in self._debts.values()
        ):
            return
        for src, debt in self._debts.items():
            meta: dict[str, Any] = {"op": "credit", "bytes": debt.credit}
            if debt.slots and self._shm_in is not None:  # the segment's secret: no forged frees
                meta["token"] = self._shm_in.token_of(src)
            for i in range(0, len(debt.slots), _FREE_CHUNK):
                self._send_control(
                    self._peer(src), {**meta, "free": debt.slots[i : i + _FREE_CHUNK]}
                )
                meta["bytes"] = 0
            if not debt.slots:
                self._send_control(self._peer(src), meta)
        self._debts.clear()
        self._debt_since = None

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
        self._inbox.disable_monitor()
        self._monitor.close(linger=0)
        self._inbox.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)  # closes any socket still open, so this never blocks
        for path in (self._ipc_path, *self._extra_paths):
            if path and os.path.exists(path):
                os.unlink(path)


_CONTROL_OPS = {
    "credit": Transport._on_credit,
    "shm_offer": Transport._on_offer,
    "shm_ready": Transport._on_ready,
    "shm_refused": Transport._on_refused,
}


class _RankKeys:
    """CURVE's admission check: a client is let in only with a key some rank published."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._known: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key not in self._known:
            t = self._transport
            for r in range(t.world_size):
                name = f"{t._prefix}/curve/{r}"
                if t._store.check([name]):
                    self._known.add(t._store.get(name))
        if key in self._known:
            return True
        log.warning("rank %d: refused a connection with an unknown CURVE key", self._transport.rank)
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def hostname() -> str:
    return socket.gethostname()
