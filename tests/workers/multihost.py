"""Train a small GPT for 3 steps over tcp (CURVE on) and record the losses.

Run by tests/faults/test_multihost.py, once per network namespace (one rank in each, as
two hosts joined by a veth pair) with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
MYELIN_HOST (the address this rank binds) set; or under `myelin run -n 2` on one host.
"""

import argparse
import functools
import json
import os
import time

import torch

import myelin
from myelin.models import GPT, GPTConfig, lm_loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    host = os.environ.get("MYELIN_HOST", "127.0.0.1")
    torch.manual_seed(0)
    trainer = myelin.Trainer(
        GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, d_model=32)),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        loss_fn=lm_loss,
        stages=2,
        microbatches=4,
        timeout=120,
        transport=myelin.TransportConfig(kind="tcp", host=host, curve=True),
    )
    with trainer:
        g = torch.Generator().manual_seed(1)
        losses, start = [], time.monotonic()
        for _ in range(3):
            x = torch.randint(0, 64, (8, 33), generator=g)
            losses.append(trainer.step(x[:, :-1], x[:, 1:]))
        record = {
            "losses": losses,
            "seconds": time.monotonic() - start,
            "curve": trainer.transport.curve,
            "same_host": trainer.world.same_host,
            "address": trainer.transport.address,
        }
    with open(os.path.join(args.out, f"rank{trainer.rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
