"""Train over tcp with CURVE on and off while outsiders try to talk to rank 1.

Run by tests/faults/test_security.py as `myelin run -n 2 secure.py --out DIR`. Each rank
records its losses with CURVE off and on; with it on, rank 0 also sends rank 1 a valid
message twice: once without CURVE, once with CURVE and the server's real public key but a
key pair of its own. Neither may get through (without CURVE both do, and are rejected).
"""

import argparse
import functools
import json
import os
import time

import torch
import torch.nn.functional as F
import zmq

import myelin
from myelin.runtime.messages import Message, encode


def train(curve, attack):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    trainer = myelin.Trainer(
        model,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=F.cross_entropy,
        stages=2,
        microbatches=2,
        timeout=30,
        transport=myelin.TransportConfig(kind="tcp", curve=curve),
    )
    with trainer:
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(3):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            losses.append(trainer.step(x, y))
            if attack and step == 0 and trainer.rank == 0:
                _attack(trainer)
        return {
            "losses": losses,
            "curve": trainer.transport.curve,
            "rejected": trainer.loop.stats.rejected + trainer.transport.stats.rejected,
        }


def _attack(trainer):
    """Send rank 1 a well-formed activation addressed to stage 0: rejected (and counted) by
    rank 1's loop if it is received."""
    prefix = trainer.transport._prefix
    address = trainer.world.store.get(f"{prefix}/addr/1").decode()
    curve = trainer.transport.curve
    server_key = trainer.world.store.get(f"{prefix}/curve/1") if curve else None
    msg = encode(Message("activation", 0, 1, 0, 0, [torch.ones(2, 16)], {}))
    ctx = zmq.Context()
    plain = ctx.socket(zmq.PUSH)
    impostor = ctx.socket(zmq.PUSH)
    if curve:
        public, secret = zmq.curve_keypair()
        impostor.curve_publickey, impostor.curve_secretkey = public, secret
        impostor.curve_serverkey = server_key
    for sock in (plain, impostor):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            sock.send_multipart(msg, flags=zmq.NOBLOCK)
        except zmq.Again:  # the handshake was refused before the send: no pipe to queue on
            pass
    time.sleep(0.5)  # long enough for a handshake and delivery, had either been allowed
    plain.close()
    impostor.close()
    ctx.term()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    result = {"plain": train(False, attack=True), "curve": train(True, attack=True)}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
