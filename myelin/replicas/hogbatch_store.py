"""Hogbatch's shared model: one flat fp32 copy of the parameters in host shared memory.

Every worker process maps the same segment (torch shared memory, handed to the worker when
it is spawned), pulls the weights into its own parameters, and adds its update in place:
`w += -lr * g`, never `w = w'`, so no other worker's update made meanwhile is lost (the
reference code copies the GPU's whole model back over the host's). Lock-free by default
(Hogwild: a race can lose one element's read-modify-write); with a lock, pulls and adds are
serialised and the order of updates is the only nondeterminism. One int64 counter per
worker, written only by its owner, gives versions: the version is their sum, and a worker's
staleness is the version when it adds minus the version when it pulled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SharedModel", "flat_grads", "load_flat"]


class SharedModel:
    """The flat fp32 weights, the per-worker update counters and the optional lock."""

    def __init__(self, weights: torch.Tensor, counters: torch.Tensor, lock: Any = None) -> None:
        self.weights = weights  # (P,) fp32, shared memory
        self.counters = counters  # (workers,) int64, shared memory
        self.lock = lock

    @classmethod
    def create(cls, params: list[torch.Tensor], workers: int, lock: Any = None) -> SharedModel:
        """A new segment holding a copy of `params` (any device or dtype, stored as fp32)."""
        flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])
        return cls(flat.share_memory_(), torch.zeros(workers, dtype=torch.int64).share_memory_(),
                   lock)  # fmt: skip

    def handles(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """What a spawned worker needs to map the same model (pass as process arguments)."""
        return self.weights, self.counters, self.lock

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        if self.lock is None:
            yield
        else:
            with self.lock:
                yield

    def version(self) -> int:
        """Updates made so far by all workers together."""
        return int(self.counters.sum())

    def pull(self, params: list[torch.Tensor]) -> int:
        """Copy the shared weights into `params` (in order); the version they were read at."""
        with self._held():
            version = self.version()
            offset = 0
            for p in params:
                n = p.numel()
                p.data.copy_(self.weights[offset : offset + n].view_as(p), non_blocking=True)
                offset += n
        return version

    def add(self, step: torch.Tensor, lr: float, worker: int) -> int:
        """weights -= lr * step (in place, as torch.optim.SGD does it) and count one update of
        `worker`; the version just before it."""
        with self._held():
            version = self.version()
            self.weights.add_(step, alpha=-lr)
            self.counters[worker] += 1
        return version

    def snapshot(self) -> torch.Tensor:
        """A private copy of the weights (for evaluation off the training path, checkpoints)."""
        with self._held():
            return self.weights.clone()

    def load_into(self, params: list[torch.Tensor], flat: torch.Tensor | None = None) -> None:
        """Write `flat` (default: the shared weights) into `params`, e.g. the user's model."""
        load_flat(params, self.snapshot() if flat is None else flat)


def load_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive pieces of `flat` into `params` (in order)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.data.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def flat_grads(params: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The parameters' gradients, concatenated into `out` (fp32, host); zero where None."""
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            out[offset : offset + n].zero_()
        else:
            out[offset : offset + n].copy_(p.grad.reshape(-1))
        offset += n
    return out
