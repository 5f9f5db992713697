"""Make one rank misbehave and record what every rank raised.

Run by tests/runtime/test_failures.py as `myelin run -n 2 failures.py --out DIR MODE`.
"""

import argparse
import functools
import json
import os
import time

import torch
import torch.nn.functional as F

import myelin

MICROBATCHES = 4


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("mode", choices=["deadline", "remote", "badbatch", "worldsize"])
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def loss_fn(out, target):
        if args.mode == "remote" and trainer.steps_done == 1:
            raise ValueError("boom in the loss")
        return F.cross_entropy(out, target)

    record = {"error_type": None, "error": None}
    start = time.monotonic()
    trainer = None
    try:
        trainer = myelin.Trainer(
            model(),
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            loss_fn=loss_fn,
            stages=3 if args.mode == "worldsize" else 2,
            microbatches=MICROBATCHES,
            timeout=3 if args.mode == "deadline" else 60,
        )
        if args.mode == "deadline" and rank == 1:
            time.sleep(20)  # never runs its stage; rank 0 must give up with a reason
        for _ in range(3):
            if args.mode == "badbatch":
                trainer.step(x[:3], y[:3])  # fewer rows than microbatches
            else:
                trainer.step(x, y)
    except Exception as exc:
        record = {"error_type": type(exc).__name__, "error": str(exc)}
    record["elapsed"] = time.monotonic() - start
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    # The launcher stops every rank once one exits with an error: wait (briefly) until the
    # others have written their records too, unless a rank is meant to be silent.
    if args.mode != "deadline":
        world = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(args.out, f"rank{r}.json")) for r in range(world)
        ):
            time.sleep(0.05)
    if trainer is not None:
        trainer.close()
    raise SystemExit(3 if record["error_type"] else 0)


if __name__ == "__main__":
    main()
