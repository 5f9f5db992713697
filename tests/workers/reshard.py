"""Checkpoints that move between layouts (issue 20.6).

    myelin run -n 2 reshard.py --out DIR save CKPT    (A, B at 2 stages: 3 steps, save, 3 more)
    myelin run -n 4 reshard.py --out DIR resume CKPT  (A, B at 4 stages; A at 2 x 2 replicas)

Chain A: an MLP with dropout, AdamW in two groups named by parameter, an LR scheduler, the
optimizer offloaded to host memory in small buckets. Chain B: a GPT whose LM head is tied
to its embedding, in bf16 (fp32 masters). Every rank records what it saw in out/rank{r}.json;
tests/test_reshard.py compares. The plain one-process resume is in the test itself.
"""

import argparse
import hashlib
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import myelin
from myelin.models import GPT, GPTConfig, lm_loss


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.Dropout(0.2),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.Dropout(0.2),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def tied_gpt():
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16, dropout=0.1)
    )
    model.head.lm_head.weight = model.embed.wte.weight
    return model


NAMES = {}  # id(tensor the optimizer steps) -> its name in the whole model


def named(params):
    """Remember the names myelin gives the factory's parameters."""
    pairs = list(params.named_parameters())
    NAMES.update((id(p), n) for n, p in pairs)
    return pairs


def decay_by_name(params):
    """AdamW without weight decay on biases, grouped by the parameters' names."""
    pairs = named(params)
    groups = [
        {"params": [p for n, p in pairs if not n.endswith("bias")], "weight_decay": 0.1},
        {"params": [p for n, p in pairs if n.endswith("bias")], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2)


def adamw(params):
    named(params)
    return torch.optim.AdamW(params, lr=1e-2)


def warmup_cosine(optimizer):
    def factor(step):
        return (step + 1) / 3 if step < 3 else 0.5 * (1 + math.cos(math.pi * min(1, step / 8)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


CHAINS = {
    "A": dict(
        build=mlp,
        optimizer=decay_by_name,
        loss_fn=F.cross_entropy,
        lr_schedule=warmup_cosine,
        offload=myelin.OffloadConfig(optimizer=True, bucket_bytes=1024),
    ),
    "B": dict(
        build=tied_gpt,
        optimizer=adamw,
        loss_fn=lm_loss,
        precision="bf16",
    ),
}


def batch(chain, step, replica=0):
    g = torch.Generator().manual_seed(100 * step + replica)
    if chain == "A":
        return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    x = torch.randint(0, 32, (8, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def trainer(chain, **kw):
    spec = dict(CHAINS[chain])
    model = spec.pop("build")()
    return myelin.Trainer(model, microbatches=4, timeout=60, **spec, **kw)


def train(t, chain, steps):
    """`steps` steps on the chain's batches, the LR scheduler (if any) stepped after each."""
    losses = []
    for _ in range(steps):
        losses.append(t.step(*batch(chain, t.steps_done, t.replica)))
        if t.lr_scheduler is not None:
            t.lr_scheduler.step()
    return losses


def digest(t):
    """SHA-256 of a tensor's dtype, shape and bytes."""
    t = t.detach().cpu().contiguous().reshape(-1)
    head = f"{t.dtype}{list(t.shape)}".encode()
    return hashlib.sha256(head + t.view(torch.uint8).numpy().tobytes()).hexdigest()


def optimizer_state(t):
    """Per parameter, by its name in the whole model: a digest of every optimizer state
    entry and its group's hyperparameters."""
    out = {}
    for group in t.optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if isinstance(v, (int, float, bool, str))}
        for p in group["params"]:
            state = t.optimizer.state.get(p, {})
            out[NAMES[id(p)]] = {
                "state": {k: digest(v) for k, v in sorted(state.items())},
                "group": hyper,
            }
    return out


def record(t):
    state = t.state_dict()
    return {
        "steps_done": t.steps_done,
        "state": None if state is None else {k: digest(v) for k, v in sorted(state.items())},
        "optimizer": optimizer_state(t),
    }


def save(ckpt):
    out = {}
    for chain in CHAINS:
        with trainer(chain, stages=2) as t:
            train(t, chain, 3)
            t.save(Path(ckpt) / chain, extra={"position": 3, "rank": t.rank})
            out[chain] = {"saved": record(t), "next": train(t, chain, 3)}
    return out


def opened_while(make):
    """What `make()` opened under the checkpoint directory (file names), via an audit hook."""
    seen = []
    active = [True]

    def hook(event, args):
        if active[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if "/ckpt/" in path:
                seen.append(os.path.basename(path))

    sys.addaudithook(hook)
    try:
        return make(), seen
    finally:
        active[0] = False


def resume(ckpt):
    out = {}
    for chain in CHAINS:
        try:
            t, opened = opened_while(lambda c=chain: trainer(c, stages=4, resume=Path(ckpt) / c))
            with t:
                out[chain] = {
                    "opened": sorted(set(opened)),
                    "steps_done": t.steps_done,
                    "extra": t.resumed_extra,
                    "next": train(t, chain, 3),
                }
        except Exception as exc:
            out[chain] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    try:
        with trainer("A", stages=2, data_parallel=2, resume=Path(ckpt) / "A") as t:
            out["A_2x2"] = {"replica": t.replica, "extra": t.resumed_extra, **record(t)}
    except Exception as exc:
        out["A_2x2"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("ckpt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = save(args.ckpt) if args.mode == "save" else resume(args.ckpt)
    with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
