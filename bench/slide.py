"""Wide softmax on the CPU: full softmax vs uniform sampling vs myelin.nn.LSHSoftmax.

    python bench/slide.py --sizes 20k     # 20K labels, 3 epochs (~3 minutes idle)
    python bench/slide.py --sizes 200k    # 200K labels, 12 epochs (~10 minutes idle)

On myelin.nn.make_xc data (sparse features, power-law labels, correlated labels), the
same network (bag of features -> 128 ReLU -> wide softmax, batch 128) trained five ways,
alternating epoch by epoch in one process: a full softmax in plain PyTorch (Adam on the
head, SparseAdam on the input bag); a sampled softmax with uniform negatives at the LSH
layer's mean candidate count (the batch's labels plus random classes), with torch's
SparseAdam ("uniform") and with LazyAdam ("uniform-lazy"); and LSHSoftmax with the same
two optimizers ("lsh-sparse", "lsh"), so each candidate rule meets the other under one
optimizer (their bias corrections differ: SparseAdam's global step count gives a rarely
touched row up to 3x larger steps than LazyAdam's per-row count). Per epoch: wall and
CPU seconds of training, P@1 on the whole test set (exact inference for all), mean
active classes (for LSH: how many were labels, retrieved, random floor); peak RSS at the
end. Prints a table and writes bench/results/slide.json.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine_info, print_table, write_json  # noqa: E402

from myelin.nn import (  # noqa: E402
    LazyAdam,
    LSHSoftmax,
    XCConfig,
    active_set,
    make_xc,
    soft_target_loss,
    sparse_rows,
)

HIDDEN, BATCH = 128, 128
# The floor (min_active) is sized so that sampled training reaches the full softmax's
# P@1: with 1,500 candidates a batch the sampled runs plateaued at 0.46 against the full
# softmax's 0.468 after 12 epochs at 200K labels; with 4,000 they pass it by epoch 11.
LSH = {"tables": 8, "min_hits": 2, "max_active": 1000, "min_active": 4000}
SIZES = {
    # labels, features, train rows, test rows, topics, epochs, LSH settings
    "20k": (20_000, 5_000, 20_000, 5_000, 500, 3, LSH | {"bits": 10}),
    "200k": (200_000, 20_000, 10_000, 2_000, 5_000, 12, LSH | {"bits": 13}),
}


class Body(nn.Module):
    """Bag of sparse features -> HIDDEN ReLU units (sparse gradients)."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(num_features, HIDDEN, mode="sum", sparse=True)
        self.bias = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, b: Any) -> torch.Tensor:
        return torch.relu(self.bag(b.features, b.offsets, per_sample_weights=b.weights) + self.bias)


class Uniform(nn.Module):
    """Sampled softmax: the batch's labels plus uniform random classes, `candidates` in all."""

    def __init__(self, num_classes: int, seed: int) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, num_classes)
        self.num_classes, self.candidates = num_classes, 1000
        self.gen = torch.Generator().manual_seed(seed)

    def loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        none = torch.zeros(0, dtype=torch.long)
        active = active_set(self.num_classes, labels, none, self.candidates, None, self.gen)
        where = torch.full((self.num_classes,), -1, dtype=torch.long)
        where[active] = torch.arange(active.numel())
        w, b = sparse_rows(active, self.head.weight, self.head.bias)
        pos = torch.where(labels >= 0, where[labels.clamp(min=0)], labels)
        return soft_target_loss(torch.addmm(b, h, w.t()), pos)


def build(method: str, size: tuple, seed: int) -> dict[str, Any]:
    labels, features, *_, lsh = size
    torch.manual_seed(seed)
    body = Body(features)
    if method == "full":
        head = nn.Linear(HIDDEN, labels)
        opts = [
            torch.optim.SparseAdam(list(body.bag.parameters()), lr=1e-3),
            torch.optim.Adam([body.bias, *head.parameters()], lr=1e-3),
        ]

        def loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return soft_target_loss(head(h), y)
    elif method == "uniform":  # plain PyTorch: SparseAdam
        head = Uniform(labels, seed)
        opts = [
            torch.optim.SparseAdam([body.bag.weight, head.head.weight, head.head.bias], lr=1e-3),
            torch.optim.Adam([body.bias], lr=1e-3),
        ]
        loss = head.loss
    elif method == "uniform-lazy":  # the LSH layer's optimizer, uniform candidates
        head = Uniform(labels, seed)
        opts = [LazyAdam([*body.parameters(), *head.parameters()], lr=1e-3)]
        loss = head.loss
    elif method == "lsh-sparse":  # the uniform peer's optimizer, LSH candidates
        head = LSHSoftmax(HIDDEN, labels, seed=seed, **lsh)
        opts = [
            torch.optim.SparseAdam([body.bag.weight, head.weight, head.bias], lr=1e-3),
            torch.optim.Adam([body.bias], lr=1e-3),
        ]
        loss = head
    else:
        head = LSHSoftmax(HIDDEN, labels, seed=seed, **lsh)
        opts = [LazyAdam([*body.parameters(), *head.parameters()], lr=1e-3)]
        loss = head
    run = {"body": body, "head": head, "opts": opts, "loss": loss, "curve": [], "active": []}
    return run | {"parts": []}


def train_epoch(run: dict[str, Any], split: Any, epoch: int) -> tuple[float, float, float]:
    """One epoch; returns wall seconds, CPU seconds and mean active classes."""
    body, head = run["body"], run["head"]
    body.train()
    head.train()
    actives, parts = [], {"labels": 0, "retrieved": 0, "floor": 0}
    wall, cpu = time.perf_counter(), time.process_time()
    for b in split.batches(BATCH, seed=epoch):
        for o in run["opts"]:
            o.zero_grad(set_to_none=True)
        run["loss"](body(b), b.labels).backward()
        for o in run["opts"]:
            o.step()
        if isinstance(head, LSHSoftmax):
            actives.append(head.stats["last_active"])
            for k in parts:
                parts[k] += head.stats[f"last_{k}"]
        elif isinstance(head, Uniform):
            actives.append(head.candidates)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if isinstance(head, LSHSoftmax):  # the mean make-up of the active sets this epoch
        run["parts"].append({k: v / max(len(actives), 1) for k, v in parts.items()})
    return wall, cpu, (sum(actives) / len(actives) if actives else float(head_width(head)))


def head_width(head: nn.Module) -> int:
    return head.out_features if isinstance(head, nn.Linear) else head.num_classes


@torch.no_grad()
def p_at_1(run: dict[str, Any], split: Any) -> float:
    """P@1 over the whole split with exact inference (all logits)."""
    body, head = run["body"], run["head"]
    body.eval()
    head.eval()
    linear = head.head if isinstance(head, Uniform) else head
    hits = 0
    for b in split.batches(1024):
        logits = torch.nn.functional.linear(body(b), linear.weight, linear.bias)
        hits += int((b.labels == logits.argmax(1, keepdim=True)).any(1).sum())
    return hits / len(split)


def run_size(name: str, methods: list[str], seed: int, epochs: int | None) -> dict[str, Any]:
    size = SIZES[name]
    labels, features, train_rows, test_rows, topics, default_epochs, lsh = size
    epochs = epochs or default_epochs
    cfg = XCConfig(
        num_labels=labels,
        num_features=features,
        train_rows=train_rows,
        test_rows=test_rows,
        topics=topics,
    )
    data = make_xc(cfg, seed=seed)
    print(
        f"\n{name}: {labels} labels, {train_rows} train / {test_rows} test rows, ceilings "
        f"{ {k: round(v, 3) for k, v in data.ceilings.items()} }",
        flush=True,
    )
    runs = {m: build(m, size, seed) for m in methods}
    for epoch in range(epochs):
        for m in methods:  # alternating, so the machine's load falls on all alike
            if m.startswith("uniform") and "lsh" in runs and runs["lsh"]["active"]:
                runs[m]["head"].candidates = round(runs["lsh"]["active"][-1])
            wall, cpu, active = train_epoch(runs[m], data.train, epoch)
            p1 = p_at_1(runs[m], data.test)
            runs[m]["curve"].append({"epoch": epoch + 1, "wall_s": wall, "cpu_s": cpu, "p1": p1})
            runs[m]["active"].append(active)
            parts = runs[m]["parts"][-1] if runs[m]["parts"] else {}
            print(
                f"  {m:12s} epoch {epoch + 1}: {wall:7.1f} s wall {cpu:7.1f} s cpu "
                f"P@1 {p1:.3f} active {active:,.0f} "
                + " ".join(f"{k} {v:,.0f}" for k, v in parts.items()),
                flush=True,
            )
    out = {
        "labels": labels,
        "features": features,
        "train_rows": train_rows,
        "test_rows": test_rows,
        "lsh": lsh,
        "ceilings": data.ceilings,
        "methods": {},
    }
    for m in methods:
        r = runs[m]
        out["methods"][m] = {
            "curve": r["curve"],
            "mean_active": sum(r["active"]) / len(r["active"]),
            "state_mib": state_bytes(r) / 2**20,
        }
        if m.startswith("lsh"):
            out["methods"][m]["stats"] = dict(r["head"].stats)
            out["methods"][m]["make_up"] = r["parts"]
    return out


def state_bytes(run: dict[str, Any]) -> int:
    """Bytes of parameters, buffers (hash tables) and optimizer state of a run."""
    tensors = [*run["body"].state_dict().values(), *run["head"].state_dict().values()]
    for o in run["opts"]:
        for st in o.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Cumulative wall seconds until the curve's P@1 first reaches `target`."""
    total = 0.0
    for point in curve:
        total += point["wall_s"]
        if point["p1"] >= target - 1e-9:
            return total
    return None


def report(results: dict[str, Any]) -> None:
    rows = []
    for name, res in results.items():
        full_final = res["methods"].get("full", {}).get("curve", [{}])[-1].get("p1")
        for m, r in res["methods"].items():
            c = r["curve"]
            walls = sorted(p["wall_s"] for p in c)
            reach = time_to(c, full_final) if full_final is not None else None
            rows.append(
                [
                    f"{name} {m}",
                    f"{walls[len(walls) // 2]:.1f}",
                    f"{sorted(p['cpu_s'] for p in c)[len(c) // 2]:.1f}",
                    " ".join(f"{p['p1']:.3f}" for p in c),
                    f"{r['mean_active']:,.0f}",
                    f"{r.get('state_mib', float('nan')):.0f}",
                    "-" if reach is None else f"{reach:.0f}",
                ]
            )
    print_table(
        [
            "run",
            "s/epoch wall",
            "s/epoch cpu",
            "P@1 per epoch",
            "active",
            "state MiB",
            "s to full's P@1",
        ],
        rows,
        title="median seconds per training epoch; P@1 on the whole test set (exact)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20k,200k", help="comma list of " + ", ".join(SIZES))
    ap.add_argument("--methods", default="lsh,lsh-sparse,uniform,uniform-lazy,full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=None, help="override every size's epochs")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/slide.json)")
    args = ap.parse_args()
    methods = args.methods.split(",")
    results = {}
    for name in args.sizes.split(","):
        results[name] = run_size(name, methods, args.seed, args.epochs)
        report(results)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the whole run: {peak:.0f} MiB")
    payload = {"results": results, "peak_rss_mib": peak, **machine_info()}
    path = write_json("slide", payload, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
