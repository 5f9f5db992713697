"""A rank's side of the hub (replicas/hub.py): start it, find it, talk to it, notice its death.

Rank 0 starts the hub process (its environment stripped of the rendezvous variables, so it
never joins the ranks' world) and publishes the hub's addresses in the torch.distributed
store; every rank connects a DEALER for requests and a SUB for the hub's heartbeats. A
hub that stays silent for `peer_timeout_s` (while waiting for a reply, or at any step's
end) is a PeerLostError on that rank, which tells the others as for any lost peer.

The hub speaks under the transport's settings: its `MessageLimits`, and CURVE where the
transport would encrypt a tcp connection (TransportConfig.curve, or tcp beyond loopback):
each rank makes a key pair for the hub and publishes the public half in the store; rank 0
hands the hub its own pair and every rank's public key, so it admits only the ranks. A
client has at most `CREDITS` requests unanswered (every request is answered, a push
too): one more waits for an answer, and an answer that does not come within the timeout
is a DeadlineError saying how many were outstanding, never an unbounded queue.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import zmq

from myelin.errors import DeadlineError, MessageError, MyelinError, PeerLostError
from myelin.runtime.messages import Message, MessageLimits, decode, encode
from myelin.runtime.transport_config import TransportConfig

__all__ = ["CREDITS", "HubClient", "connect_hub", "start_hub"]

CREDITS = 4  # requests a client may have unanswered at the hub

HUB_RANK = -1  # what PeerLostError names as the lost peer when the hub is gone
_RENDEZVOUS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def start_hub(
    clients: int,
    host: str,
    timeout_s: float,
    limits: MessageLimits | None = None,
    curve: dict[str, Any] | None = None,
) -> tuple[subprocess.Popen, dict]:
    """Start the hub process for `clients` clients; its process and addresses. `curve`:
    the hub's key pair and its clients' public keys, {"secret", "public", "clients"}, z85."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "myelin.replicas.hub", "--clients", str(clients)]
    cmd += ["--parent", str(os.getpid()), "--host", host]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    settings = {"limits": dataclasses.asdict(limits or MessageLimits()), "curve": curve}
    proc.stdin.write(json.dumps(settings) + "\n")
    proc.stdin.close()
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        raise MyelinError(f"the hub did not start within {timeout_s:.0f}s (exit {proc.poll()})")
    return proc, json.loads(line)


class HubClient:
    """One rank's connection to the hub, for the slot `key` (its stage)."""

    def __init__(
        self,
        addresses: dict[str, str],
        key: int,
        rank: int,
        *,
        peer_timeout_s: float,
        timeout_s: float,
        limits: MessageLimits,
        process: subprocess.Popen | None = None,
        keys: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        """keys: (this client's public, its secret, the hub's public key) under CURVE."""
        self.key, self.rank, self.limits = key, rank, limits
        self.peer_timeout_s, self.timeout_s = peer_timeout_s, timeout_s
        self.process = process  # set on the rank that started the hub
        self.ctx = zmq.Context()
        self.req = self.ctx.socket(zmq.DEALER)
        self.beats = self.ctx.socket(zmq.SUB)
        for sock in (self.req, self.beats):
            sock.setsockopt(zmq.LINGER, 1000)
            if keys is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
        self.beats.setsockopt(zmq.CONFLATE, 1)
        self.beats.setsockopt(zmq.SUBSCRIBE, b"")
        self.req.connect(addresses["serve"])
        self.beats.connect(addresses["beat"])
        self.last_beat = time.monotonic()
        self.requests = 0
        self.unanswered = 0  # requests sent whose answer has not come (at most CREDITS)
        self.bytes = 0  # tensor bytes sent and received

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def check(self) -> None:
        """Raise PeerLostError if the hub has been silent for peer_timeout_s (at once on
        the rank that started it, when its process is gone)."""
        if self.process is not None and self.process.poll() is not None:
            raise PeerLostError(
                HUB_RANK,
                "serving the EASGD center",
                f"rank {self.rank}: the hub (the host-memory parameter server) exited with "
                f"status {self.process.returncode}",
            )
        while self.beats.poll(0):
            self.beats.recv()
            self.last_beat = time.monotonic()
        silent = time.monotonic() - self.last_beat
        if silent > self.peer_timeout_s:
            raise PeerLostError(
                HUB_RANK,
                "serving the EASGD center",
                f"rank {self.rank}: the hub (the host-memory parameter server) sent no "
                f"heartbeat for {silent:.1f}s (limit {self.peer_timeout_s:g}s); it died or hangs",
            )

    def _send(self, op: str, tensors: list[torch.Tensor], **meta: Any) -> int:
        """Send a request once a credit is free; its number, which its answer carries."""
        self.check()
        while self.unanswered >= CREDITS:
            self._answer(f"a credit for {op}")  # an earlier push's answer
        frame_max = max(self.limits.max_tensor_bytes, self.limits.max_header_bytes)
        for t in tensors:  # a bigger frame: the hub drops the connection, answering nothing
            if t.numel() * t.element_size() > frame_max:
                raise MessageError(
                    "tensors",
                    f"{op} of {t.numel() * t.element_size()} bytes is over the hub's frame "
                    f"limit of {frame_max} (MessageLimits.max_tensor_bytes)",
                )
        number = self.requests
        msg = Message(
            "control", max(self.rank, 0), number, 0, self.key, tensors, {"op": op, **meta}
        )
        frames, deadline = encode(msg), time.monotonic() + self.timeout_s
        while True:
            try:
                self.req.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                break
            except zmq.Again:  # no connection to the hub (yet, or it refused this one)
                self.req.poll(100, zmq.POLLOUT)
                self.check()
                if time.monotonic() > deadline:
                    raise DeadlineError(
                        f"rank {self.rank} could not hand {op} to the hub within "
                        f"{self.timeout_s:g}s: no connection to it"
                    ) from None
        self.requests += 1
        self.unanswered += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return number

    def _answer(self, waiting_for: str) -> Message:
        """The hub's next answer, within the timeout, its heartbeats watched meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        while not self.req.poll(100):
            self.check()
            if time.monotonic() > deadline:
                raise DeadlineError(
                    f"rank {self.rank} waited {self.timeout_s:g}s for the hub's answer to "
                    f"{waiting_for}, with {self.unanswered} requests unanswered (at most "
                    f"{CREDITS}); the hub is alive (its heartbeats come) but does not serve"
                )
        msg = decode(self.req.recv_multipart(copy=False), self.limits)
        self.unanswered -= 1
        if msg.meta.get("op") == "refused":
            problem = f"the hub refused a request: {msg.meta.get('problem')}"
            raise MessageError(str(msg.meta.get("field")), problem)
        if msg.meta.get("op") != "reply":
            raise MessageError("meta.op", f"the hub answered with {msg.meta.get('op')!r}")
        self.bytes += sum(t.numel() * t.element_size() for t in msg.tensors)
        return msg

    def _reply(self, op: str, number: int) -> list[torch.Tensor]:
        """The answer to request `number` (answers to earlier pushes come first)."""
        while True:
            msg = self._answer(op)
            if msg.step == number:
                return [t.clone() for t in msg.tensors]

    def settle(self) -> None:
        """Wait for the answer to every request sent: this client's pushes have landed."""
        while self.unanswered:
            self._answer("an earlier push")

    def init(self, x: torch.Tensor) -> None:
        """Make the slot x unless another rank made it first."""
        self._put("init", x)

    def set(self, x: torch.Tensor) -> None:
        """Make the slot x, whatever it holds (a resumed run's center)."""
        self._put("set", x)

    def _put(self, op: str, x: torch.Tensor) -> None:
        self._reply(op, self._send(op, [x.detach().float().cpu().contiguous()]))

    def read(self) -> torch.Tensor:
        """The slot as the hub holds it now (a pull)."""
        return self._reply("read", self._send("read", []))[0]

    def push(self, e: torch.Tensor) -> None:
        """slot += e, without waiting for the answer (a push; it returns a credit)."""
        self._send("push", [e.detach().float().cpu().contiguous()])

    def exchange(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """The slot before; the hub moves it by alpha (x - slot) meanwhile."""
        x = x.detach().float().cpu().contiguous()
        return self._reply("exchange", self._send("exchange", [x], alpha=float(alpha)))[0]

    def close(self) -> None:
        """Leave the hub (the last to leave stops it); wait for the process we started."""
        try:
            msg = Message(
                "control", max(self.rank, 0), self.requests, 0, self.key, [], {"op": "bye"}
            )
            self.req.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.req.close()
        self.beats.close()
        self.ctx.term()
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def connect_hub(
    world: Any, ctx: Any, center: torch.Tensor, timeout_s: float | None = None
) -> HubClient:
    """Start the hub (rank 0) or find it (the others), connect, and seed the center."""
    transport = ctx.transport or TransportConfig()
    wait_s = timeout_s or ctx.timeout_s
    size, store = world.layout.world_size, world.store
    mine = zmq.curve_keypair() if transport.wants_curve("tcp") else None  # (public, secret)
    process, addresses = None, None
    if store is not None:
        generation = store.add(f"myelin/hubs/{world.rank}", 1)
        key = f"myelin/hub/{generation}"
        if mine is not None:
            store.set(f"{key}/key/{world.rank}", mine[0])
        if world.rank == 0:
            curve = None
            if mine is not None:
                names = [f"{key}/key/{r}" for r in range(size)]
                _wait_keys(world, names, "the ranks' CURVE keys for the hub", wait_s)
                curve = _hub_curve([store.get(n) for n in names])
            process, addresses = start_hub(size, transport.host, wait_s, transport.limits, curve)
            world.store.set(key, json.dumps(addresses))
        else:
            _wait_keys(world, [key], "the hub's address", wait_s)
            addresses = json.loads(world.store.get(key).decode())
    else:
        curve = _hub_curve([mine[0]]) if mine is not None else None
        process, addresses = start_hub(size, transport.host, wait_s, transport.limits, curve)
    keys = None
    if mine is not None:
        keys = (mine[0], mine[1], addresses["public"].encode())
    client = HubClient(
        addresses,
        world.stage,
        world.rank,
        peer_timeout_s=transport.peer_timeout_s,
        timeout_s=wait_s,
        limits=transport.limits,
        process=process,
        keys=keys,
    )
    client.init(center)
    return client


def _hub_curve(clients: list[bytes]) -> dict[str, Any]:
    """A key pair for the hub and the public keys it admits, as start_hub takes them."""
    public, secret = zmq.curve_keypair()
    return {
        "public": public.decode(),
        "secret": secret.decode(),
        "clients": [k.decode() for k in clients],
    }


def _wait_keys(world: Any, keys: list[str], what: str, timeout_s: float) -> None:
    """Wait for store keys, bounded (and aware of lost peers where the world knows them)."""
    if getattr(world, "waits", None) is not None:
        world.waits.keys(world.store, keys, what, timeout_s)
    else:
        world.store.wait(keys, timedelta(seconds=timeout_s))
