"""Hogbatch's evaluator: the loss of copies of the shared weights, in a thread of its own,
so that training never waits for an evaluation (each completed epoch's and, with
`eval_every_s`, a copy every so many seconds)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from myelin.replicas.hogbatch_store import load_flat

__all__ = ["Evaluator"]


class Evaluator:
    """The loss of a copy of the weights, in a thread, so training never waits for it."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, data: tuple, params: list) -> None:
        self.model, self.loss_fn, self.data, self.params = model, loss_fn, data, params
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hogbatch-eval")
        self.futures: list[tuple[int, float, float, Any]] = []
        self.timed: list[tuple[float, float, Any]] = []

    def submit(self, epoch: int, wall_s: float, weights: torch.Tensor, seen: float = 0.0) -> None:
        """Evaluate `weights` (a private copy) as of `wall_s` seconds into training, when
        epoch `epoch` completed, `seen` epochs' worth of samples in."""
        self.futures.append((epoch, wall_s, seen, self.pool.submit(self._loss, weights)))

    def submit_timed(self, epochs: float, wall_s: float, weights: torch.Tensor) -> None:
        """The same for a copy taken on the clock, `epochs` epochs' worth of samples in."""
        self.timed.append((epochs, wall_s, self.pool.submit(self._loss, weights)))

    def now(self, weights: torch.Tensor) -> float:
        """The loss of `weights` (a private copy), waited for: fit's eval_first."""
        return self.pool.submit(self._loss, weights).result()

    def loss(self, weights: torch.Tensor) -> float:
        """The loss of `weights` now, in the caller's thread (after `close`, too)."""
        return self._loss(weights)

    def _loss(self, weights: torch.Tensor) -> float:
        load_flat(self.params, weights)
        with torch.no_grad():
            total, n = 0.0, self.data[0].shape[0]
            for i in range(0, n, 8192):
                xb, yb = self.data[0][i : i + 8192], self.data[1][i : i + 8192]
                total += float(self.loss_fn(self.model(xb), yb)) * xb.shape[0]
        return total / n

    def results(self) -> list[dict[str, float]]:
        """Each epoch's loss, in the order epochs completed: epoch, wall seconds at the copy,
        epochs' worth of samples trained by then, loss."""
        return [{"epoch": e, "wall_s": w, "epochs": n, "loss": f.result()}
                for e, w, n, f in self.futures]  # fmt: skip

    def timed_results(self) -> list[dict[str, float]]:
        """The copies taken on the clock: wall seconds, epochs' worth of samples, loss."""
        return [{"wall_s": w, "epochs": e, "loss": f.result()} for e, w, f in self.timed]

    def finished(self, start: int) -> list[dict[str, float]]:
        """The results from the `start`-th on whose evaluation is over, in order; no wait."""
        out = []
        for e, w, _, f in self.futures[start:]:
            if not f.done():
                break
            out.append({"epoch": e, "wall_s": w, "loss": f.result()})
        return out

    def close(self) -> None:
        """Finish what was submitted and end the thread."""
        self.pool.shutdown(wait=True)
