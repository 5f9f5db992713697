"""A two-stage pipeline in a dozen lines.

myelin run -n 2 examples/quickstart.py            # or: torchrun --nproc-per-node 2 ...
myelin run -n 4 examples/quickstart.py --data-parallel 2
"""

import argparse
import functools

import torch
import torch.nn.functional as F

import myelin

parser = argparse.ArgumentParser()
parser.add_argument("--data-parallel", type=int, default=1)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

torch.manual_seed(0)  # every rank builds the same model, then keeps only its stage
model = torch.nn.Sequential(
    torch.nn.Linear(32, 256),
    torch.nn.GELU(),
    torch.nn.Linear(256, 256),
    torch.nn.GELU(),
    torch.nn.Linear(256, 10),
)
with myelin.Trainer(
    model,
    optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
    loss_fn=F.cross_entropy,
    stages=2,
    microbatches=8,
    data_parallel=args.data_parallel,
) as trainer:
    data = torch.Generator().manual_seed(1 + trainer.replica)  # one data stream per replica
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        loss = trainer.step(x, (x @ teacher).argmax(dim=1))
        if trainer.rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss:.4f}")
    if trainer.rank == 0:
        print(f"final loss {loss:.4f}")
