"""Train a 2-stage pipeline and checkpoint after every step until killed.

Run by tests/test_checkpoint.py as `myelin run -n 2 save_forever.py --out DIR CKPT`; each
rank writes its pid to DIR/pid{rank} so the test can kill it mid-save.
"""

import argparse
import functools
import os
import time

import torch

import myelin


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("ckpt")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # ~2 MiB/stage
    with myelin.Trainer(
        model,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        loss_fn=torch.nn.functional.mse_loss,
        stages=2,
        microbatches=2,
        timeout=30,
    ) as trainer:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            x = torch.randn(8, 256)
            trainer.step(x, x)
            trainer.save(args.ckpt)


if __name__ == "__main__":
    main()
