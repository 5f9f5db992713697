"""bench/hogbatch.py's configurations with real SGD on a simulated clock: no wall time.

    python3 bench/hogbatch_clock.py                  # 16 CPU workers (~3 minutes)
    python3 bench/hogbatch_clock.py --cpu-workers 2  # the earlier setting

Each worker reads the shared weights when its update starts and adds -lr x its gradient
when it ends, `per update + per sample x batch` declared seconds later (the emulated costs
of bench/hogbatch.py), so staleness is what the declared speeds give and nothing else: no
runner round trips, no CPU contention, no busy fractions under 1. The dispatcher and the
adaptive rule are the runner's own. It answers what the schedule can give at best, and
how far the real emulated runs are from it. Prints time to several target losses.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hogbatch import CPU_COST, DEVICE_COST, covtype_like, mlp  # noqa: E402
from hogbatch import time_to as bench_time_to  # noqa: E402

from myelin.replicas.hogbatch_dispatch import Dispatcher  # noqa: E402
from myelin.replicas.hogbatch_rule import Controller  # noqa: E402

Evals = list[tuple[float, float]]


class Model:
    """The MLP as one flat weight vector: gradient and loss at any weights."""

    def __init__(self, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.x, self.y = data
        self.net = mlp(2, 64)
        self.params = list(self.net.parameters())
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.w0 = torch.nn.utils.parameters_to_vector(self.params).detach().clone()

    def weights(self) -> torch.Tensor:
        """A fresh copy of the initial weights (every run starts from the same model)."""
        return self.w0.clone()

    def grad(self, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        torch.nn.utils.vector_to_parameters(w, self.params)
        for p in self.params:
            p.grad = None
        self.loss_fn(self.net(self.x[idx]), self.y[idx]).backward()
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def loss(self, w: torch.Tensor) -> float:
        torch.nn.utils.vector_to_parameters(w, self.params)
        with torch.no_grad():
            return float(self.loss_fn(self.net(self.x), self.y))


def hogbatch(m: Model, *, batch: int, cpus: int, lr: float, cpu_lr: float, seconds: float,
             ctl: Controller | None = None, cpu_cost: tuple = CPU_COST,
             dev_cost: tuple = DEVICE_COST) -> tuple[Evals, list[int]]:  # fmt: skip
    """Worker 0 (device) at `batch` (or the controller's), `cpus` workers at batch 4."""
    w, disp = m.weights(), Dispatcher(len(m.x), 10_000, 0)
    costs, lrs = [dev_cost] + [cpu_cost] * cpus, [lr] + [lr * cpu_lr] * cpus
    heap: list = []
    evals: Evals = []
    updates = [0] * (cpus + 1)

    def start(k: int, now: float) -> None:
        b = (ctl.batch if ctl else batch) if k == 0 else 4
        r = disp.take(k, b)
        idx = disp.permutation(r.epoch)[r.start : r.start + r.count]
        g = m.grad(w, idx)
        heapq.heappush(heap, (now + costs[k][0] + r.count * costs[k][1], k, r, g))

    for k in range(cpus + 1):
        start(k, 0.0)
    while True:
        end, k, r, g = heapq.heappop(heap)
        while len(evals) + 1 <= end:
            evals.append((len(evals) + 1.0, m.loss(w)))
        if end >= seconds:
            return evals, updates
        w.add_(g, alpha=-lrs[k])
        updates[k] += 1
        if ctl:
            ctl.observe(k, r.count, costs[k][0] + r.count * costs[k][1], device=k == 0)
        disp.done(k, r)
        start(k, end)


def sync_dp(m: Model, *, batch: int, workers: int, lr: float, seconds: float) -> Evals:
    """One SGD step on the union of `workers` equal batches per round of the slowest cost."""
    w, disp = m.weights(), Dispatcher(len(m.x), 10_000, 0)
    round_s = max(o + s * batch for o, s in (DEVICE_COST, CPU_COST))
    now, evals, epoch = 0.0, [], 0
    while now < seconds:
        perm = disp.permutation(epoch)
        epoch += 1
        for start in range(0, len(perm), batch * workers):
            w.add_(m.grad(w, perm[start : start + batch * workers]), alpha=-lr)
            now += round_s
            while len(evals) + 1 <= now:
                evals.append((len(evals) + 1.0, m.loss(w)))
    return evals


def time_to(evals: Evals, target: float) -> float | None:
    """Seconds when the loss first reaches `target`, interpolated between evals (the
    bench's own rule, over (seconds, loss) pairs)."""
    rows = [{"wall_s": t, "loss": loss, "epoch": i} for i, (t, loss) in enumerate(evals)]
    return bench_time_to(rows, target)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-workers", type=int, default=16)
    p.add_argument("--ratio", type=float, default=0.03)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--cpu-lr-scale", type=float, default=0.25)
    args = p.parse_args()
    torch.set_num_threads(1)
    m, n, secs = Model(covtype_like(20000)), args.cpu_workers, args.seconds
    targets = (0.45, 0.43, 0.40, 0.35)
    rows: list[tuple[str, Evals]] = []
    for b in (64, 256, 1024):
        rows.append((f"device alone ({b})", hogbatch(m, batch=b, cpus=0, lr=args.lr,
                                                     cpu_lr=1, seconds=secs)[0]))  # fmt: skip
    for b in (4, 16, 64):
        rows.append((f"sync DP ({n + 1} x {b})",
                     sync_dp(m, batch=b, workers=n + 1, lr=args.lr, seconds=secs)))  # fmt: skip
    ev, up = hogbatch(m, batch=64, cpus=n, lr=args.lr, cpu_lr=args.cpu_lr_scale, seconds=secs)
    rows.append((f"Hogbatch fixed (64), ratio {up[0] / sum(up[1:]):.3f}", ev))
    for eps in (0.1, 0.3, 0.5):
        ctl = Controller(lo=16, hi=1024, ratio=args.ratio, budget=eps, adaptive=True)
        ev, up = hogbatch(m, batch=1024, cpus=n, lr=args.lr, cpu_lr=args.cpu_lr_scale,
                          seconds=secs, ctl=ctl)  # fmt: skip
        rows.append((f"Adaptive eps={eps}, ratio {up[0] / sum(up[1:]):.3f}, b {ctl.batch}", ev))
    print(f"seconds to loss {' / '.join(map(str, targets))}, loss at {secs:g} s")
    for name, ev in rows:
        ts = [time_to(ev, t) for t in targets]
        cells = " / ".join("-" if t is None else f"{t:.1f}" for t in ts)
        print(f"  {name}: {cells}; {ev[-1][1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
