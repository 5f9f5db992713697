"""Two equal stages of real compute under GPipe, profiled; and what each rank holds in memory.

Run by tests/profile/test_bubble.py as `myelin run -n 2 bubble.py --out DIR [--rows R]`.
Each stage is 6 x (Linear(384, 384), Tanh); 4 microbatches of R rows, 12 steps, with
`profile=DIR/prof` (rank 0 saves the report there at close). Before closing, every rank
saves `trainer.profile_report()` to the same DIR/every, three times over, as an SPMD
script would. Each rank writes rank{r}.json: its memory_stats() and the shared memory
it holds resident (RssShmem of /proc/self/status), after the steps.
"""

import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F

import myelin

WIDTH, BLOCKS, MICROBATCHES, STEPS = 384, 6, 4, 12


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=64, help="rows per microbatch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(2 * BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    trainer = myelin.Trainer(
        torch.nn.Sequential(*layers),
        optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
        loss_fn=F.mse_loss,
        stages=2,
        partition=[2 * BLOCKS, 2 * BLOCKS],
        microbatches=MICROBATCHES,
        schedule="gpipe",
        timeout=60,
        profile=os.path.join(args.out, "prof"),
    )
    g = torch.Generator().manual_seed(trainer.rank)
    for _ in range(STEPS):
        x = torch.randn(args.rows * MICROBATCHES, WIDTH, generator=g)
        trainer.step(x, torch.randn(x.shape, generator=g))
    record = {
        "memory": trainer.memory_stats(),
        "rss_shmem_kib": status_kib("RssShmem"),
        "vm_rss_kib": status_kib("VmRSS"),
    }
    for _ in range(3):  # every rank saves the same report to the same directory
        trainer.profile_report().save(os.path.join(args.out, "every"))
    record["saved_every"] = True
    trainer.close()
    with open(os.path.join(args.out, f"rank{trainer.rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
