"""How ranks talk to each other: `TransportConfig`, checked field by field when built, and
the counters a transport keeps (`TransportStats`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import zmq

from myelin.errors import ConfigError
from myelin.runtime.addresses import is_address, is_loopback
from myelin.runtime.messages import MessageLimits

__all__ = ["TransportConfig", "TransportStats", "is_address", "is_loopback"]

log = logging.getLogger(__name__)

_KINDS = ("auto", "ipc", "tcp")


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
    shm_bytes: the most each (sender, receiver) segment may hold; memory is committed as
        slots reach into it; a tensor that does not fit travels inline.
    shm_wait_s: how long a message may wait for a free slot, once nothing is in flight,
        before it goes inline instead (a receiver holding every slot cannot stall a sender).
    ring_bytes: with shared memory, a ring of this many bytes per (sender, receiver) pair
        carries whole messages (header and small tensors), with a doorbell to wake the
        receiver, so they skip ZeroMQ's I/O threads (most of a small message's latency);
        0 sends every header over ZeroMQ. x86-64 Linux only; elsewhere it is ignored.
    spin_us: with rings, how long poll checks them before it sleeps: a message that comes
        within it is taken without a wake-up (a sleeping core's wake costs tens of us).
        0 never spins.
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
    ring_bytes: int = 2**20
    spin_us: float = 200.0
    curve: bool | None = None
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 5.0
    exit_after_loss_s: float | None = 5.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"TransportConfig.kind={self.kind!r} must be one of {_KINDS}")
        if not isinstance(self.host, str) or not is_address(self.host):
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
        ring = self.ring_bytes
        if type(ring) is not int or (ring and not 2**16 <= ring <= 2**30) or ring % 8:
            raise ConfigError(
                f"TransportConfig.ring_bytes={ring!r} must be 0 (no ring) or a multiple of 8 "
                f"in [{2**16}, {2**30}]"
            )
        _check_number("spin_us", self.spin_us, 0.0, 10_000.0)
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
        wanted = kind == "tcp" and not is_loopback(self.host)
        if wanted and not zmq.has("curve"):
            log.warning(
                "TransportConfig.curve: tcp binds %s, beyond loopback, but this pyzmq has no "
                "CURVE support; connections are not encrypted",
                self.host,
            )
            return False
        return wanted


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
    ring_messages: int = 0  # messages sent whole through a shared-memory ring
    dropped_connections: int = 0  # inbox connections that closed: a peer left, or ZeroMQ
    # cut off one that sent a frame over MessageLimits (ZMQ_MAXMSGSIZE)
