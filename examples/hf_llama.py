"""A HuggingFace Llama in two pipeline stages, in as HF builds it and out as HF loads it.

myelin run -n 2 examples/hf_llama.py --out llama-out            # or: torchrun --nproc-per-node 2
myelin run -n 2 examples/hf_llama.py --start-from llama-out     # go on from the saved folder

A small Llama built from a config (nothing downloaded) learns byte-level text, this
Python's own library. myelin finds its embeddings, decoder layers and head by itself, and
each stage runs Llama's own forward, so the loss is HF's own (labels are the input ids,
shifted inside the model). `trainer.save_pretrained` writes a folder that
`AutoModelForCausalLM.from_pretrained` reads. With --start-from, every rank builds the
model on the meta device and reads only its own stage's weights from such a folder: how
a model too large for one host's memory is started.
"""

import argparse
import functools
import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import myelin
from myelin.data import Batches, decode, encode, load_stdlib_text

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--out", default="llama-out", help="where save_pretrained writes")
parser.add_argument("--start-from", default=None, help="a folder save_pretrained wrote")
args = parser.parse_args()

config = LlamaConfig(
    vocab_size=256,  # one token per byte
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=0,
)
if args.start_from:
    with myelin.init_empty():  # shapes only: no rank ever holds the whole model
        model = AutoModelForCausalLM.from_config(config)
else:
    torch.manual_seed(0)  # every rank builds the same model; each keeps its stage
    model = AutoModelForCausalLM.from_config(config)


class Labelled:
    """Batches as HF takes them: the labels are the input ids (the model shifts them)."""

    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    def __iter__(self):
        return ((x, x) for x, _ in self.batches)


data = load_stdlib_text(max_bytes=2 << 20)
with myelin.Trainer(
    model,  # [embeddings, 4 decoder layers, final norm + LM head], found by myelin
    optimizer=functools.partial(torch.optim.AdamW, lr=2e-3),
    stages=2,
    microbatches=4,
    weights=args.start_from,  # None: start from the model as built
) as trainer:
    train = Batches(data.train, 128, batch_size=16, seed=0, stream=("train", trainer.replica))
    val = Batches(data.val, 128, batch_size=16, seed=0, stream=("val", trainer.replica))
    history = trainer.fit(
        Labelled(train), steps=args.steps, eval_loader=Labelled(val), eval_every=25, eval_batches=4
    )
    if trainer.rank == 0:
        for h in history:
            if "val_loss" in h:
                print(f"step {h['step']:4d}  loss {h['loss']:.3f}  val loss {h['val_loss']:.3f}")
    trainer.save_pretrained(args.out)  # every rank writes its stage; rank 0 config and index

if int(os.environ.get("RANK", "0")) == 0:
    plain = AutoModelForCausalLM.from_pretrained(args.out)  # a plain HuggingFace model again
    prompt = encode("def ")[None]
    text = plain.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
    print(f"loaded {args.out} with from_pretrained; it writes: {decode(text[0])!r}")
