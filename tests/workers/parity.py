"""Issue 17 on two processes: half-precision export, dropout streams, in-place first ops and
clipping, each against plain PyTorch in one process (tests/workers/_reference.py).

Run by tests/test_parity_pipeline.py as `myelin run -n 2 parity.py --out DIR`. Each case
runs in its own Trainer(s) over both processes and records what it saw (or its error, so
one failing case does not hide the others) in out/rank{r}.json.
"""

import argparse
import functools
import json
import os
import traceback

import torch
import torch.nn.functional as F
from _reference import batches, mlp
from _reference import train as reference
from torch import nn

import myelin

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
HOST = myelin.OffloadConfig(optimizer=True, bucket_bytes=1024)


def trainer(model, **kw):
    kw = {"microbatches": 4, "timeout": 60, **kw}
    return myelin.Trainer(model, kw.pop("optimizer", ADAMW), F.cross_entropy, **kw)


# -- 17.1 --------------------------------------------------------------------------------------


def export(precision, offload):
    """state_dict() of a 2-stage half-precision run against the reference's fp32 masters."""
    data = batches(3)
    with trainer(mlp(), stages=2, precision=precision, offload=offload) as t:
        for x, y in data:
            t.step(x, y)
        state = t.state_dict()
    if state is None:
        return {}
    model = mlp()
    scale = 2.0**16 if precision == "fp16" else None
    _, masters, _ = reference(
        model, ADAMW, F.cross_entropy, data, 4, precision=precision, loss_scale=scale
    )
    names = [n for n, _ in model.named_parameters()]
    return {
        "keys_match": sorted(state) == sorted(model.state_dict()),
        "dtypes": sorted({str(v.dtype) for v in state.values()}),
        "nan": any(bool(v.isnan().any()) for v in state.values()),
        "unequal": [n for n, m in zip(names, masters) if not torch.equal(state[n].float(), m)],
    }


# -- 17.2 --------------------------------------------------------------------------------------


class SeenDropout(nn.Dropout):
    """Dropout that remembers the mask of every forward."""

    def __init__(self, p):
        super().__init__(p)
        self.masks = []

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.masks.append("".join("1" if v else "0" for v in (out != 0).flatten().tolist()))
        return out


def dropout_masks(stages, data_parallel, seed=0):
    """Each rank's dropout masks over one step of 8 microbatches (torch.manual_seed(seed)
    at the top, as every script does)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 32), SeenDropout(0.5), nn.Linear(32, 32), SeenDropout(0.5), nn.Linear(32, 4)
    )
    partition = [2, 3] if stages == 2 else None  # a dropout on each stage
    with trainer(
        model, stages=stages, data_parallel=data_parallel, microbatches=8, partition=partition
    ) as t:
        x, y = batches(1, rows=16)[0]
        t.step(x, y)
        return [m.masks for m in t.module if isinstance(m, SeenDropout)]


def dropout():
    return {
        "pipeline": dropout_masks(2, 1),
        "pipeline_again": dropout_masks(2, 1),
        "pipeline_other_seed": dropout_masks(2, 1, seed=1),
        "replicas": dropout_masks(1, 2),
    }


# -- 17.3 --------------------------------------------------------------------------------------


def inplace():
    """An MLP of in-place ReLUs whose default split puts a ReLU first on stage 1."""

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 64),
            nn.ReLU(inplace=True),
            nn.Linear(64, 8),
            nn.ReLU(inplace=True),
            nn.Linear(8, 4),
        )

    data = batches(3)
    with trainer(build(), stages=2) as t:
        first = type(t.module[0]).__name__
        losses = [t.step(x, y) for x, y in data]
    want, _, _ = reference(build(), ADAMW, F.cross_entropy, data, 4)
    return {"stage_begins_with": first, "losses": losses, "want": want}


# -- 17.5 --------------------------------------------------------------------------------------


def clip(stages, data_parallel, offload):
    """max_grad_norm over 2 stages (or 2 replicas) against clip_grad_norm_ in one process."""
    replicas = [batches(4, seed=r) for r in range(data_parallel)]
    with trainer(
        mlp(), stages=stages, data_parallel=data_parallel, offload=offload, max_grad_norm=0.05
    ) as t:
        losses = [t.step(x, y) for x, y in replicas[t.replica]]
        state = t.state_dict()
    # the replicas' batches side by side: the gradient average over replicas
    joined = [
        (torch.cat([r[s][0] for r in replicas]), torch.cat([r[s][1] for r in replicas]))
        for s in range(4)
    ]
    model = mlp()
    m = 4 * data_parallel
    want, masters, _ = reference(model, ADAMW, F.cross_entropy, joined, m, max_grad_norm=0.05)
    names = [n for n, _ in model.named_parameters()]
    diff = None
    if state is not None:
        diff = max(float((state[n] - w).abs().max()) for n, w in zip(names, masters))
    return {"losses": losses, "want": want, "param_diff": diff}


class _HeadFirst(nn.Module):
    """mlp()'s layers, with the head registered first: clip_grad_norm_ sums the norms in
    registration order, which is not the layers' order here."""

    def __init__(self) -> None:
        super().__init__()
        layers = list(mlp())
        self.head = layers[-1]
        self.body = nn.Sequential(*layers[:-1])

    def pipeline_layers(self) -> list[nn.Module]:
        return [*self.body, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def clip_head_first():
    data = batches(4)
    with trainer(_HeadFirst(), stages=2, max_grad_norm=0.05) as t:
        losses = [t.step(x, y) for x, y in data]
        state = t.state_dict()
    model = _HeadFirst()
    want, masters, _ = reference(model, ADAMW, F.cross_entropy, data, 4, max_grad_norm=0.05)
    unequal = None
    if state is not None:
        named = zip((n for n, _ in model.named_parameters()), masters)
        unequal = [n for n, w in named if not torch.equal(state[n], w)]
    return {"losses": losses, "want": want, "unequal": unequal}


class _Head(nn.Module):
    """A head whose weight is the embedding's (tied across the two stages)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.embedding.weight.t()).flatten(0, 1)


def _frozen_tied() -> nn.Sequential:
    torch.manual_seed(0)
    embedding = nn.Embedding(32, 16)
    embedding.weight.requires_grad_(False)
    return nn.Sequential(
        embedding, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), _Head(embedding)
    )


def frozen_tied_bf16():
    """A frozen embedding tied to the head on the other stage, in bf16: nothing to sum
    between the holders (it failed with a KeyError), the rest trains as one process."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 32, (8, 6), generator=g) for _ in range(3)]
    data = [(x, x.flatten()) for x in data]
    with trainer(_frozen_tied(), stages=2, partition=[2, 3], precision="bf16") as t:
        losses = [t.step(x, y) for x, y in data]
        state = t.state_dict()
    model = _frozen_tied()
    frozen = model[0].weight.detach().clone()
    want, masters, _ = reference(model, ADAMW, F.cross_entropy, data, 4, precision="bf16")
    names = [n for n, p in _frozen_tied().named_parameters() if p.requires_grad]
    unequal = None
    if state is not None:
        unequal = [n for n, m in zip(names, masters) if not torch.equal(state[n], m)]
        if not torch.equal(state["0.weight"], frozen):
            unequal.append("0.weight")
    return {"losses": losses, "want": want, "unequal": unequal}


CASES = {
    "export_bf16": lambda: export("bf16", None),
    "export_bf16_host": lambda: export("bf16", HOST),
    "export_fp16": lambda: export("fp16", None),
    "dropout": dropout,
    "inplace": inplace,
    "clip_stages": lambda: clip(2, 1, None),
    "clip_stages_host": lambda: clip(2, 1, HOST),
    "clip_replicas": lambda: clip(1, 2, None),
    "clip_head_first": clip_head_first,
    "frozen_tied_bf16": frozen_tied_bf16,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name in args.cases:
        try:
            results[name] = CASES[name]()
        except Exception as exc:
            results[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(),
            }
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
