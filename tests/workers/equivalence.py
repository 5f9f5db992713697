"""Train cases with myelin and with one process doing gradient accumulation; record both.

Run by tests/runtime/test_pipeline.py as `myelin run -n N equivalence.py --out DIR CASE...`,
where CASE is
model:stages:data_parallel:schedule:transport:lengths[:init[:offload[:precision[:tied_grads]]]],
e.g.
`gpt:2:1:1f1b:tcp:varied` or `hf:2:1:message-driven:ipc:fixed:meta` (built under
myelin.init_empty(); the reference is the eager model given myelin.init_layers), or
`gpt:2:1:gpipe:ipc:fixed:eager:both` (offload one of OFFLOAD's keys), or
`gpt:2:1:1f1b:ipc:fixed:eager:both:bf16` (the reference stays fp32: compare such cases
with each other), or `hf:2:1:1f1b:ipc:fixed:eager:none:fp32:microbatch` (GPT-2's tied
embedding and head added per microbatch).
Every case must use all N processes.
"""

import argparse
import functools
import hashlib
import json
import os

import torch
import torch.nn.functional as F

import myelin
from myelin.models import GPT, GPTConfig, lm_loss
from myelin.partition import layers_of
from myelin.runtime.messages import tensor_frame

STEPS, MICROBATCHES, LR = 5, 4, 3e-3

# What each offload name turns on; min_bytes=0 pages out even these small models' tensors.
OFFLOAD = {
    "none": None,
    "act": myelin.OffloadConfig(activations=True, min_bytes=0),
    "opt": myelin.OffloadConfig(optimizer=True, bucket_bytes=4096),
    "stream": myelin.OffloadConfig(optimizer="stream", bucket_bytes=4096),
    "both": myelin.OffloadConfig(activations=True, optimizer=True, min_bytes=0, bucket_bytes=4096),
}


class Fan(torch.nn.Module):
    """Turns one tensor into three: features, a gate, and an int64 mask."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x):
        h = self.lin(x)
        return h, torch.sigmoid(h), (x[:, :1] > 0).long()


class Gated(torch.nn.Module):
    """Takes and returns several tensors, so stage boundaries carry more than one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, h, gate, mask):
        return torch.tanh(self.lin(h)) * gate + mask, gate * 0.5, mask


class Merge(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 8)

    def forward(self, h, gate, mask):
        return self.lin(h + gate) * (1 + mask)


def build(name):
    torch.manual_seed(0)
    if name == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=32,
            n_layer=3,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg), lm_loss
    if name == "multi":
        return myelin.StageModule([Fan(), Gated(), Gated(), Merge()]), F.cross_entropy
    if name == "mlp":
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 8),
        ), F.cross_entropy
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=32)
    return GPT(cfg), lm_loss


def batch(name, step, replica, varied):
    """Inputs and targets of one replica's step; varied: a list of different-length microbatches."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    if name in ("mlp", "multi"):
        return torch.randn(4 * MICROBATCHES, 16, generator=g), torch.randint(
            0, 8, (16,), generator=g
        )
    if not varied:
        x = torch.randint(0, 64, (2 * MICROBATCHES, 17), generator=g)
        return x[:, :-1], x[:, 1:]
    xs, ys = [], []
    for _ in range(MICROBATCHES):
        t = int(torch.randint(4, 32, (), generator=g))
        x = torch.randint(0, 64, (2, t + 1), generator=g)
        xs.append(x[:, :-1])
        ys.append(x[:, 1:])
    return xs, ys


def pieces(x, y):
    if isinstance(x, list):
        return list(zip(x, y))
    return list(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)))


def logits(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def reference(name, replicas, varied, init):
    model, loss_fn = build(name)
    if init == "meta":
        myelin.init_layers(model, layers_of(model))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for r in range(replicas):
            for xi, yi in pieces(*batch(name, step, r, varied)):
                loss = loss_fn(logits(model, xi), yi)
                (loss / (MICROBATCHES * replicas)).backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / (MICROBATCHES * replicas))
    with torch.no_grad():
        pairs = [p for r in range(replicas) for p in pieces(*batch(name, STEPS, r, varied))]
        eval_loss = sum(loss_fn(logits(model, x), y).item() for x, y in pairs) / len(pairs)
    return model, losses, eval_loss


def run_case(case):
    name, stages, dp, schedule, kind, lengths, *more = case.split(":")
    stages, dp, varied = int(stages), int(dp), lengths == "varied"
    init = more[0] if more else "eager"
    offload = OFFLOAD[more[1] if len(more) > 1 else "none"]
    precision = more[2] if len(more) > 2 else "fp32"
    tied_grads = more[3] if len(more) > 3 else "step"
    if init == "meta":
        with myelin.init_empty():
            model, loss_fn = build(name)
    else:
        model, loss_fn = build(name)
    trainer = myelin.Trainer(
        model,
        optimizer=functools.partial(torch.optim.AdamW, lr=LR),
        loss_fn=loss_fn,
        stages=stages,
        data_parallel=dp,
        microbatches=MICROBATCHES,
        schedule=schedule,
        transport=myelin.TransportConfig(kind=kind),
        timeout=60,
        offload=offload,
        precision=precision,
        tied_grads=tied_grads,
    )
    with trainer:
        losses = [trainer.step(*batch(name, s, trainer.replica, varied)) for s in range(STEPS)]
        eval_loss = trainer.eval_step(*batch(name, STEPS, trainer.replica, varied))
        ref_model, ref_losses, ref_eval = reference(name, dp, varied, init)
        losses.append(eval_loss)
        ref_losses.append(ref_eval)
        mine = list(trainer.module.parameters())
        first = trainer.module.first_layer
        ref_layers = layers_of(ref_model)[first : first + len(trainer.module)]
        theirs = [p for layer in ref_layers for p in layer.parameters()]
        assert len(mine) == len(theirs), (len(mine), len(theirs))
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(mine, theirs))
        digest = hashlib.sha256(b"".join(bytes(tensor_frame(p.detach())) for p in mine))
        full = trainer.state_dict()  # gathered on rank 0, under the model's own keys
        full_diff = None
        if full is not None:
            want = ref_model.state_dict()
            assert sorted(full) == sorted(want), (sorted(full), sorted(want))
            full_diff = max(float((full[k] - want[k]).abs().max()) for k in want)
        return {
            "state_dict_diff": full_diff,
            "rank": trainer.rank,
            "stage": trainer.stage,
            "replica": trainer.replica,
            "losses": losses,
            "ref_losses": ref_losses,
            "param_diff": diff,
            "digest": digest.hexdigest(),
            "transport": trainer.transport.kind if trainer.transport else None,
            "memory": trainer.memory_stats(),
            "weights": trainer.loop.stats.weights,  # W operations run (split backwards)
            "overlapped": getattr(trainer.loop.replicas, "armed", None),  # steps
        }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {case: run_case(case) for case in args.cases}
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
