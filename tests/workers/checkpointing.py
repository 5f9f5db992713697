"""Save a 2-stage pipeline mid-run, resume it in a new Trainer, record both runs' losses.

Run by tests/test_checkpoint.py as `myelin run -n 2 checkpointing.py --out DIR CKPT`.
"""

import argparse
import functools
import json
import os

import torch

import myelin
from myelin.models import GPT, GPTConfig, lm_loss


def build():
    torch.manual_seed(0)
    return GPT(
        GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16, dropout=0.1)
    )


def batch(step):
    x = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(step))
    return x[:, :-1], x[:, 1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("ckpt")
    args = parser.parse_args()
    kw = dict(
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
        loss_fn=lm_loss,
        stages=2,
        microbatches=2,
        timeout=60,
    )
    with myelin.Trainer(build(), **kw) as trainer:
        for _ in range(3):
            trainer.step(*batch(trainer.steps_done))
        trainer.save(args.ckpt)
        expected = [trainer.step(*batch(trainer.steps_done)) for _ in range(3)]
    with myelin.Trainer(build(), resume=args.ckpt, **kw) as again:
        resumed = [again.step(*batch(again.steps_done)) for _ in range(3)]
        rank = again.rank
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"expected": expected, "resumed": resumed}, f)


if __name__ == "__main__":
    main()
