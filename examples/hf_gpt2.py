"""HuggingFace GPT-2 (built from a config: nothing is downloaded) in two pipeline stages.

myelin run -n 2 examples/hf_gpt2.py                  # or: torchrun --nproc-per-node 2 ...
myelin run -n 2 examples/hf_gpt2.py --steps 100 --meta

The token embedding (stage 0) and the LM head (stage 1) share one weight in GPT-2; myelin
keeps the two copies tied by summing their gradients every step. With --meta the model
is built on the meta device and each rank allocates only its own stage.
"""

import argparse
import functools

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import myelin
from myelin.data import Batches, load_stdlib_text
from myelin.models import lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--meta", action="store_true", help="build under myelin.init_empty()")
args = parser.parse_args()

torch.manual_seed(0)  # every rank builds the same eager model; each keeps its stage
config = GPT2Config(
    vocab_size=256,
    n_positions=128,
    n_embd=128,
    n_layer=4,
    n_head=4,
    bos_token_id=0,
    eos_token_id=0,
)
if args.meta:
    with myelin.init_empty():
        model = GPT2LMHeadModel(config)
else:
    model = GPT2LMHeadModel(config)

data = load_stdlib_text(max_bytes=2 << 20)  # byte-level text: this Python's own library
with myelin.Trainer(
    model,  # split as [embeddings, blocks..., final norm + LM head]
    optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
    loss_fn=lm_loss,  # logits (B, T, 256) against next bytes (B, T)
    stages=2,
    microbatches=4,
) as trainer:
    train = Batches(data.train, 128, batch_size=16, seed=0, stream=("train", trainer.replica))
    val = Batches(data.val, 128, batch_size=16, seed=0, stream=("val", trainer.replica))
    history = trainer.fit(train, steps=args.steps, eval_loader=val, eval_every=25, eval_batches=4)
    if trainer.rank == 0:
        for h in history:
            if "val_loss" in h:
                print(f"step {h['step']:4d}  loss {h['loss']:.3f}  val loss {h['val_loss']:.3f}")
    state = trainer.state_dict()  # the whole model on rank 0, under GPT-2's own keys
    if trainer.rank == 0:
        plain = GPT2LMHeadModel(config)
        plain.load_state_dict(state)  # back to a plain HuggingFace model
        tied = plain.lm_head.weight.data_ptr() == plain.transformer.wte.weight.data_ptr()
        print(f"loaded into a plain GPT2LMHeadModel; embedding and head tied: {tied}")
