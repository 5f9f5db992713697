"""The learning rates bench/replicas.py uses, from one sweep in a single process.

    python3 bench/replicas_lr.py      # about 3 minutes on one core

bench/replicas.py's GPT, data and 200 steps, trained in one process on the 4 replicas'
batches together (4 x 8 rows: AllReduce's update), validated on its 8 fixed batches:
AdamW over {3e-4, 6e-4, 1e-3, 2e-3, 3e-3, 1e-2} and heavy-ball SGD (momentum 0.9, the
local update of MEASGD and of its anchor) over {0.03, 0.05, 0.1, 0.2, 0.3, 1.0}, seed 0;
the three best of each again under seeds 1 and 2 (model and data). The bench takes each
optimizer's lowest mean validation loss. Results: bench/results/replicas_lr.json.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, machine_info  # noqa: E402
from replicas import model  # noqa: E402

GRID = {"adamw": (3e-4, 6e-4, 1e-3, 2e-3, 3e-3, 1e-2), "sgd-m": (0.03, 0.05, 0.1, 0.2, 0.3, 1.0)}


def run(data, val, kind: str, lr: float, seed: int, steps: int = 200) -> float:
    """The validation loss after `steps` steps of `kind` at `lr` (nan if it diverged)."""
    from myelin.data import Batches
    from myelin.models import lm_loss

    torch.manual_seed(seed)
    net = model()
    if kind == "adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    streams = [Batches(data.train, 64, 8, seed=seed, stream=("train", r)) for r in range(4)]
    for step in range(steps):
        xs, ys = zip(*[b.get(step) for b in streams], strict=True)
        opt.zero_grad()
        lm_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    with torch.no_grad():
        return sum(float(lm_loss(net(x), y)) for x, y in val) / len(val)


def main() -> None:
    from myelin.data import Batches, load_stdlib_text

    torch.set_num_threads(1)
    data = load_stdlib_text(max_bytes=2 << 20)
    val = [Batches(data.val, 64, 8, seed=0, stream=("val",)).get(i) for i in range(8)]
    losses: dict[str, dict[str, list[float]]] = {}
    for kind, grid in GRID.items():
        first = {lr: run(data, val, kind, lr, 0) for lr in grid}
        ranked = sorted((v, lr) for lr, v in first.items() if not math.isnan(v))[:3]
        losses[kind] = {str(lr): [v] for lr, v in first.items()}
        for _, lr in ranked:
            losses[kind][str(lr)] += [run(data, val, kind, lr, seed) for seed in (1, 2)]
        for lr, vs in losses[kind].items():
            print(f"{kind:6} lr {lr:7}  val {' '.join(f'{v:.3f}' for v in vs)}", flush=True)
    best = {
        kind: min((sum(vs) / len(vs), float(lr)) for lr, vs in by.items() if len(vs) == 3)[1]
        for kind, by in losses.items()
    }
    print(f"best: {best}")
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": machine_info(), "losses": losses, "best": best}
    (RESULTS / "replicas_lr.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
