"""Train a small pipeline (a stage per rank) for a while, so a test can do something to
the launcher.

Run by tests/faults/test_launcher.py as `myelin run -n 2 longrun.py --out DIR [--save]`
(or under torchrun); with --save each step is followed by a checkpoint save. After its
first step each rank writes DIR/started/rank{r}.json (its pid and its parent's); it
trains until --seconds have passed. It prints nothing: what the job prints is the
launcher's and myelin's. Flight records go to DIR/flight/. If the trainer raises, the
rank writes DIR/rank{r}.json (what, when) and re-raises.
"""

import argparse
import functools
import json
import os
import time

import torch
import torch.nn.functional as F

import myelin


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--save", action="store_true", help="save a checkpoint every step")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    trainer = myelin.Trainer(
        model,
        optimizer=functools.partial(torch.optim.SGD, lr=0.01),
        loss_fn=F.cross_entropy,
        stages=int(os.environ["WORLD_SIZE"]),
        microbatches=4,
        timeout=60,
        run_dir=args.out,
    )
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    end = time.monotonic() + args.seconds
    try:
        trainer.step(x, y)
        os.makedirs(os.path.join(args.out, "started"), exist_ok=True)
        with open(os.path.join(args.out, "started", f"rank{rank}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "time": time.time()}, f)
        while time.monotonic() < end:
            trainer.step(x, y)
            if args.save:
                trainer.save(os.path.join(args.out, "ckpt"))
            time.sleep(0.01)
    except BaseException as exc:
        record = {"error_type": type(exc).__name__, "error": str(exc), "time": time.time()}
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        raise
    trainer.close()


if __name__ == "__main__":
    main()
