"""A byte-level GPT trained on the Python standard library's own source, in two stages.

torchrun --nproc-per-node 2 examples/train_gpt.py      # or: myelin run -n 2 examples/train_gpt.py
torchrun --nproc-per-node 2 examples/train_gpt.py --steps 50

Nothing to download: the text is this Python's library (myelin.data). The full job,
with a progress bar, metrics, a run directory and samples, is `myelin train`.
"""

import argparse
import functools

import torch

import myelin
from myelin.data import Batches, load_stdlib_text
from myelin.models import GPT, GPTConfig, lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()

data = load_stdlib_text(max_bytes=4 << 20)  # uint8 bytes, split into train and val by file
# Layer i is initialised from seed + i, so every rank builds the same model; each keeps its stage.
config = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=128, seed=0)
with myelin.Trainer(
    GPT(config),
    optimizer=functools.partial(torch.optim.AdamW, lr=2e-3),
    loss_fn=lm_loss,
    stages=2,
    microbatches=4,
) as trainer:
    # Batch i is a function of (seed, stream, i): the ranks of a replica get the same one.
    train = Batches(data.train, 128, batch_size=16, seed=0, stream=("train", trainer.replica))
    val = Batches(data.val, 128, batch_size=16, seed=0, stream=("val", trainer.replica))
    history = trainer.fit(train, steps=args.steps, eval_loader=val, eval_every=50, eval_batches=4)
    if trainer.rank == 0:
        for h in history:
            if "val_loss" in h:
                print(f"step {h['step']:4d}  loss {h['loss']:.3f}  val loss {h['val_loss']:.3f}")
    state = trainer.state_dict()  # every rank takes part; the whole model arrives on rank 0
    if trainer.rank == 0:
        torch.save(state, "gpt.pt")  # a plain GPT state_dict: GPT(config).load_state_dict(...)
