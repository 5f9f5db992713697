"""The hub: a host-memory parameter server in a process of its own, speaking myelin messages.

    python -m myelin.replicas.hub --parent PID --host 127.0.0.1 --clients N < settings.json

It holds named flat fp32 tensors ("slots": one per pipeline stage for EASGD's center) in
host memory and serves requests that arrive as myelin messages (control kind, msgpack
header and raw tensor frames, decoded strictly under MessageLimits; nothing unpickled) on
a ZeroMQ ROUTER socket, one at a time, first come first served:

    init     tensors [x]      the slot becomes x unless it exists; reply: ok
    read     -                reply: [slot]                         (a pull)
    push     tensors [e]      slot += e; reply: ok (a credit back)  (hogwild EASGD; a push)
    exchange tensors [x], alpha   reply: [old slot]; slot += alpha (x - old)  (async EASGD)
    bye      -                a client leaves; the hub exits when all have left

A second thread publishes a heartbeat every `--beat-s` seconds on a PUB socket, so
clients tell a dead hub from a busy one. The hub exits when its parent (the rank that
started it) dies. It is a process, not a thread, so it never competes for a rank's GIL.
The first line on stdin is JSON with its settings: the ranks' `MessageLimits` (a frame
over them drops the sender's connection, a message over them is refused) and, when the
transport encrypts (TransportConfig.curve), the hub's CURVE key pair and the public keys
of the clients it admits (over stdin: a secret never shows in a process list); the first
line on stdout is JSON with both addresses. Every request is answered, so a client bounds
its unanswered requests (hub_client.py's credits) and the hub's queue with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

import torch
import zmq

from myelin.errors import MessageError
from myelin.runtime.curve import admit_keys
from myelin.runtime.messages import Message, MessageLimits, decode, encode

__all__ = ["Hub", "OPS", "main"]

OPS = ("init", "set", "read", "push", "exchange", "bye")


class Hub:
    """The slots and the rules that change them; no sockets (tested without any)."""

    def __init__(self) -> None:
        self.slots: dict[int, torch.Tensor] = {}
        self.served = dict.fromkeys(OPS, 0)

    def handle(self, msg: Message) -> list[torch.Tensor] | None:
        """Apply one request; the tensors to reply with (None: no reply)."""
        op = msg.meta.get("op")
        if op not in OPS:
            raise MessageError("meta.op", f"{op!r} is not one of {list(OPS)}")
        self.served[op] += 1
        if op == "bye":
            return None
        key = msg.stage
        if op in ("init", "set"):  # init: unless another rank made it first; set: replace
            _one_tensor(msg)
            if op == "set" or key not in self.slots:
                self.slots[key] = msg.tensors[0].float().clone()
            return []
        slot = self.slots.get(key)
        if slot is None:
            raise MessageError("stage", f"slot {key} was never initialised")
        if op == "read":
            return [slot.clone()]
        x = _one_tensor(msg, like=slot)
        if op == "push":
            slot.add_(x)
            return []
        alpha = msg.meta.get("alpha")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise MessageError("meta.alpha", f"{alpha!r} must be a number in [0, 1]")
        old = slot.clone()
        slot.add_(float(alpha) * (x - old))
        return [old]


def _one_tensor(msg: Message, like: torch.Tensor | None = None) -> torch.Tensor:
    if len(msg.tensors) != 1 or msg.tensors[0].dtype != torch.float32:
        raise MessageError("tensors", f"{msg.meta.get('op')} takes one float32 tensor")
    x = msg.tensors[0]
    if like is not None and x.shape != like.shape:
        raise MessageError("tensors[0].shape", f"{list(x.shape)}, the slot is {list(like.shape)}")
    return x


def _beat(sock: zmq.Socket, every_s: float, stop: threading.Event) -> None:
    """The heartbeat thread: the PUB socket is used by this thread only after the start."""
    while not stop.wait(every_s):
        sock.send(b"beat")


def serve(
    host: str,
    clients: int,
    parent: int,
    beat_s: float,
    limits: MessageLimits,
    curve: dict[str, Any] | None = None,
) -> int:
    """Bind, announce the addresses on stdout, serve until every client left or the
    parent died; returns the exit status. `curve`: {"secret", "public", "clients"} (z85
    keys): both sockets are CURVE servers that admit only the clients' keys."""
    ctx = zmq.Context()
    auth = None
    if curve is not None:
        auth = admit_keys(ctx, [k.encode() for k in curve["clients"]], "the hub")
    router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
    for sock in (router, pub):
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            sock.curve_secretkey = curve["secret"].encode()
            sock.curve_publickey = curve["public"].encode()
            sock.curve_server = True
    router.setsockopt(zmq.MAXMSGSIZE, max(limits.max_tensor_bytes, limits.max_header_bytes))
    port = router.bind_to_random_port(f"tcp://{host}")
    beat_port = pub.bind_to_random_port(f"tcp://{host}")
    addresses = {"serve": f"tcp://{host}:{port}", "beat": f"tcp://{host}:{beat_port}"}
    if curve is not None:
        addresses["public"] = curve["public"]  # the clients' curve_serverkey
    print(json.dumps(addresses))
    sys.stdout.flush()
    stop = threading.Event()
    beats = threading.Thread(target=_beat, args=(pub, beat_s, stop), daemon=True)
    beats.start()
    hub, left, rejected = Hub(), 0, 0
    try:
        while left < clients:
            if os.getppid() != parent:
                return 3  # the rank that started the hub is gone
            if not router.poll(200):
                continue
            frames = router.recv_multipart(copy=False)
            ident, body = frames[0].bytes, frames[1:]
            try:
                msg = decode(body, limits)
                reply = hub.handle(msg)
            except MessageError as exc:
                rejected += 1
                print(f"myelin hub: rejected a message from {ident!r}: {exc}", file=sys.stderr)
                meta = {"op": "refused", "field": exc.field, "problem": exc.problem[:300]}
                out = Message("control", 0, 0, 0, 0, [], meta)
                router.send_multipart([ident, *encode(out)], copy=False)
                continue
            if msg.meta.get("op") == "bye":
                left += 1
            if reply is not None:
                out = Message("control", 0, msg.step, 0, msg.stage, reply, {"op": "reply"})
                router.send_multipart([ident, *encode(out)], copy=False)
        return 0
    finally:
        stop.set()
        beats.join(timeout=2)
        router.close()
        pub.close()
        if auth is not None:
            auth.stop()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m myelin.replicas.hub")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--beat-s", type=float, default=0.25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    line = sys.stdin.readline()
    settings = json.loads(line) if line.strip() else {}
    limits = MessageLimits(**settings.get("limits", {}))
    return serve(args.host, args.clients, args.parent, args.beat_s, limits, settings.get("curve"))


def describe(hub: Hub) -> dict[str, Any]:
    """What the hub served, by operation, and the slots it holds."""
    return {"served": dict(hub.served), "slots": {k: v.numel() for k, v in hub.slots.items()}}


if __name__ == "__main__":
    sys.exit(main())
