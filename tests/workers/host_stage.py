"""A 2-stage pipeline ending in an LSHSoftmax, each stage placed by `stage_devices`.

Run by tests/test_stage_devices.py as `myelin run -n 2 host_stage.py --out DIR [--meta]`;
each rank writes its device, its torch thread count, the step losses and an eval loss.
With --meta the model is built under myelin.init_empty() and each rank materialises its
stage (the reference: `build()` given `myelin.init_layers`).
"""

import argparse
import functools
import json
import os

import torch
from torch import nn

import myelin
from myelin.nn import LazyAdam, LSHSoftmax

STEPS = 4


def build() -> nn.Sequential:
    """The model both the pipeline and the test's single process train."""
    torch.manual_seed(0)
    head = LSHSoftmax(16, 500, bits=4, tables=4, min_active=60, check_every=2, seed=3)
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), head)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    labels = torch.randint(500, (8, 2), generator=g)
    labels[::3, 1] = -1
    return torch.randn(8, 32, generator=g), labels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--meta", action="store_true")
    args = parser.parse_args()
    if args.meta:
        with myelin.init_empty():
            model = build()
    else:
        model = build()
    head = model[2]
    with myelin.Trainer(
        model,
        optimizer=functools.partial(LazyAdam, lr=0.01),
        loss_fn=head.loss,
        stages=2,
        partition=[2, 1],
        stage_devices=["cpu", "cpu"],
        cpu_threads=[1, 2],
        timeout=60,
    ) as trainer:
        losses = [trainer.step(*batch(s)) for s in range(STEPS)]
        eval_loss = trainer.eval_step(*batch(99))
        result = {
            "device": str(trainer.world.device),
            "threads": torch.get_num_threads(),
            "losses": losses,
            "eval": eval_loss,
            "active": int(head.active.numel()) if trainer.is_last_stage else None,
        }
        rank = trainer.rank
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
