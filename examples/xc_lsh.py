"""Extreme classification with an LSH-sampled softmax as the last pipeline stage.

    myelin run -n 2 examples/xc_lsh.py              # 2 stages; the wide layer's on the CPU
    python examples/xc_lsh.py --stages 1             # one process

Synthetic data (myelin.nn.make_xc: sparse features, power-law labels, no download) goes
through features -> 128 ReLU -> LSHSoftmax over `--labels` classes. In training the last
layer computes only the classes its hash tables find for the batch (plus the batch's
labels and a random floor); LazyAdam updates only the rows that were computed. With 2
stages `stage_devices` puts the wide layer's stage on the host CPU, and the first on the
GPU when there is one. Prints the loss and P@1 on the test set (exact inference).
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn

import myelin
from myelin.nn import LazyAdam, LSHSoftmax, XCConfig, make_xc


def dense(batch, num_features: int) -> torch.Tensor:
    """A bag of features as a dense (B, num_features) tensor: what a pipeline stage sends."""
    rows = len(batch)
    ends = torch.cat([batch.offsets[1:], torch.tensor([batch.features.numel()])])
    row = torch.repeat_interleave(torch.arange(rows), ends - batch.offsets)
    x = torch.zeros(rows, num_features)
    x.index_put_((row, batch.features), batch.weights, accumulate=True)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labels", type=int, default=5_000)
    ap.add_argument("--features", type=int, default=2_000)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--stages", type=int, default=2, choices=(1, 2))
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()

    cfg = XCConfig(
        num_labels=args.labels,
        num_features=args.features,
        train_rows=args.rows,
        test_rows=2_000,
        topics=max(1, args.labels // 40),
    )
    data = make_xc(cfg, seed=0)
    torch.manual_seed(0)
    head = LSHSoftmax(128, args.labels, bits=9, tables=8, max_active=400, min_active=800)
    model = nn.Sequential(nn.Linear(args.features, 128), nn.ReLU(), head)
    gpu = "cuda" if torch.cuda.is_available() else "cpu"
    placement = {"stage_devices": [gpu, "cpu"], "cpu_threads": [None, 2], "partition": [2, 1]}
    trainer = myelin.Trainer(
        model,
        optimizer=functools.partial(LazyAdam, lr=2e-3),
        loss_fn=head.loss,  # the labels reach the layer through the loss
        stages=args.stages,
        **(placement if args.stages == 2 else {}),
    )
    with trainer:
        for epoch in range(args.epochs):
            losses = [
                trainer.step(dense(b, args.features), b.labels)
                for b in data.train.batches(args.batch, seed=epoch)
            ]
            if not trainer.is_last_stage:
                continue
            line = f"epoch {epoch + 1} loss {sum(losses) / len(losses):.4f}"
            line += f" active {head.stats['last_active']} rebuilds {head.stats['rebuilds']}"
            if args.stages == 1:  # one process holds the whole model: measure P@1 here
                line += f" P@1 {p_at_1(model, data, args.features):.3f}"
            print(line, flush=True)
        state = trainer.state_dict()
    if state is not None and args.stages == 2:  # rank 0 holds the whole model's weights
        model.cpu().load_state_dict(state)  # (its stage may have been placed on the GPU)
        print(f"P@1 {p_at_1(model, data, args.features):.3f}")
    if state is not None:
        print(f"ceilings: {data.ceilings}")


@torch.no_grad()
def p_at_1(model: nn.Module, data, num_features: int) -> float:
    """Share of test rows whose top class (exact inference) is one of their labels."""
    model.eval()
    hits, device = 0, next(model.parameters()).device  # one process: the model's device
    for b in data.test.batches(512):
        top = model(dense(b, num_features).to(device)).argmax(1, keepdim=True).cpu()
        hits += int((b.labels == top).any(1).sum())
    model.train()
    return hits / len(data.test)


if __name__ == "__main__":
    main()
