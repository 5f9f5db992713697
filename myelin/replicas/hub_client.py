"""A rank's side of the hub (replicas/hub.py): start it, find it, talk to it, notice its death.

Rank 0 starts the hub process (its environment stripped of the rendezvous variables, so it
never joins the ranks' world) and publishes the hub's addresses in the torch.distributed
store; every rank connects a DEALER for requests and a SUB for the hub's heartbeats. A
hub that stays silent for `peer_timeout_s` (while waiting for a reply, or at any step's
end) is a PeerLostError on that rank, which tells the others as for any lost peer.
"""

from __future__ import annotations

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

__all__ = ["HubClient", "connect_hub", "start_hub"]

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


def start_hub(clients: int, host: str, timeout_s: float) -> tuple[subprocess.Popen, dict]:
    """Start the hub process for `clients` clients; its process and addresses."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "myelin.replicas.hub", "--clients", str(clients)]
    cmd += ["--parent", str(os.getpid()), "--host", host]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
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
    ) -> None:
        self.key, self.rank, self.limits = key, rank, limits
        self.peer_timeout_s, self.timeout_s = peer_timeout_s, timeout_s
        self.process = process  # set on the rank that started the hub
        self.ctx = zmq.Context()
        self.req = self.ctx.socket(zmq.DEALER)
        self.beats = self.ctx.socket(zmq.SUB)
        for sock in (self.req, self.beats):
            sock.setsockopt(zmq.LINGER, 1000)
        self.beats.setsockopt(zmq.CONFLATE, 1)
        self.beats.setsockopt(zmq.SUBSCRIBE, b"")
        self.req.connect(addresses["serve"])
        self.beats.connect(addresses["beat"])
        self.last_beat = time.monotonic()
        self.requests = 0
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

    def _send(self, op: str, tensors: list[torch.Tensor], **meta: Any) -> None:
        self.check()
        msg = Message(
            "control", max(self.rank, 0), self.requests, 0, self.key, tensors, {"op": op, **meta}
        )
        self.req.send_multipart(encode(msg), copy=False)
        self.requests += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)

    def _reply(self, op: str) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        while not self.req.poll(100):
            self.check()
            if time.monotonic() > deadline:
                raise DeadlineError(
                    f"rank {self.rank} waited {self.timeout_s:.0f}s for the hub's answer to {op}"
                )
        msg = decode(self.req.recv_multipart(copy=False), self.limits)
        if msg.meta.get("op") != "reply":
            raise MessageError("meta.op", f"the hub answered {op} with {msg.meta.get('op')!r}")
        self.bytes += sum(t.numel() * t.element_size() for t in msg.tensors)
        return [t.clone() for t in msg.tensors]

    def init(self, x: torch.Tensor) -> None:
        """Make the slot x unless another rank made it first."""
        self._send("init", [x.detach().float().cpu().contiguous()])
        self._reply("init")

    def read(self) -> torch.Tensor:
        """The slot as the hub holds it now (a pull)."""
        self._send("read", [])
        return self._reply("read")[0]

    def push(self, e: torch.Tensor) -> None:
        """slot += e, without waiting (a push)."""
        self._send("push", [e.detach().float().cpu().contiguous()])

    def exchange(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """The slot before; the hub moves it by alpha (x - slot) meanwhile."""
        self._send("exchange", [x.detach().float().cpu().contiguous()], alpha=float(alpha))
        return self._reply("exchange")[0]

    def close(self) -> None:
        """Leave the hub (the last to leave stops it); wait for the process we started."""
        try:
            msg = Message(
                "control", max(self.rank, 0), self.requests, 0, self.key, [], {"op": "bye"}
            )
            self.req.send_multipart(encode(msg), copy=False)
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
    transport = ctx.transport
    host = transport.host if transport is not None else "127.0.0.1"
    peer_timeout_s = transport.peer_timeout_s if transport is not None else 5.0
    limits = transport.limits if transport is not None else MessageLimits()
    wait_s = timeout_s or ctx.timeout_s
    process, addresses = None, None
    size = world.layout.world_size
    if world.store is not None:
        generation = world.store.add(f"myelin/hubs/{world.rank}", 1)
        key = f"myelin/hub/{generation}"
        if world.rank == 0:
            process, addresses = start_hub(size, host, wait_s)
            world.store.set(key, json.dumps(addresses))
        else:
            world.store.wait([key], timedelta(seconds=wait_s))
            addresses = json.loads(world.store.get(key).decode())
    else:
        process, addresses = start_hub(size, host, wait_s)
    client = HubClient(
        addresses,
        world.stage,
        world.rank,
        peer_timeout_s=peer_timeout_s,
        timeout_s=wait_s,
        limits=limits,
        process=process,
    )
    client.init(center)
    return client
