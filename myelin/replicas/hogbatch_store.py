"""Hogbatch's shared model: one flat fp32 copy of the parameters in host shared memory.

Every worker process maps the same segment (torch shared memory, handed to the worker when
it is spawned), pulls the weights into its own parameters, and adds its update in place:
`w += -lr * g`, never `w = w'`, so no other worker's update made meanwhile is lost (the
reference code copies the GPU's whole model back over the host's). Lock-free by default
(Hogwild: a race can lose one element's read-modify-write); with a lock, pulls and adds are
serialised and the order of updates is the only nondeterminism. One int64 counter per
worker, written only by its owner, gives versions: the version is their sum, and a worker's
staleness is the version when it adds minus the version when it pulled. With a lock, a
shared int says which worker holds it, so the runner can free it when that worker dies
holding it (the others would wait on it for ever), and every wait for it is bounded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from myelin.errors import DeadlineError

__all__ = ["SharedModel", "flat_grads", "load_flat"]


class SharedModel:
    """The flat fp32 weights, the per-worker update counters and the optional lock."""

    def __init__(self, weights: torch.Tensor, counters: torch.Tensor, lock: Any = None,
                 owner: torch.Tensor | None = None, *, me: int = -1,
                 timeout_s: float | None = None) -> None:  # fmt: skip
        self.weights = weights  # (P,) fp32, shared memory
        self.counters = counters  # (workers,) int64, shared memory
        self.lock = lock
        self.owner = owner  # (1,) int64, shared memory: who holds the lock, -1 when free
        self.me = me  # this process: a worker's index, -1 for the runner
        self.timeout_s = timeout_s  # the longest wait for the lock (None: for ever)

    @classmethod
    def create(cls, params: list[torch.Tensor], workers: int, lock: Any = None,
               timeout_s: float | None = None) -> SharedModel:  # fmt: skip
        """A new segment holding a copy of `params` (any device or dtype, stored as fp32)."""
        flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])
        owner = None if lock is None else torch.full((1,), -1, dtype=torch.int64).share_memory_()
        return cls(flat.share_memory_(), torch.zeros(workers, dtype=torch.int64).share_memory_(),
                   lock, owner, timeout_s=timeout_s)  # fmt: skip

    def handles(self) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor | None]:
        """What a spawned worker needs to map the same model (pass as process arguments)."""
        return self.weights, self.counters, self.lock, self.owner

    @contextlib.contextmanager
    def _held(self, timeout_s: float | None = None) -> Iterator[None]:
        if self.lock is None:
            yield
            return
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not self.lock.acquire(timeout=timeout_s):
            raise DeadlineError(
                f"Hogbatch: the shared model's lock was not free within {timeout_s}s "
                f"(held by worker {int(self.owner[0])})"
            )
        self.owner[0] = self.me
        try:
            yield
        finally:
            self.owner[0] = -1
            self.lock.release()

    def release_from(self, worker: int) -> bool:
        """Free the lock if `worker`, now dead, holds it; whether it did."""
        if self.lock is None or int(self.owner[0]) != worker:
            return False
        self.owner[0] = -1
        self.lock.release()
        return True

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

    def add(
        self,
        step: torch.Tensor,
        lr: float,
        worker: int,
        read: int | None = None,
        max_staleness: int | None = None,
    ) -> tuple[int, float]:
        """weights -= lr * step (in place, as torch.optim.SGD does it) and count one update of
        `worker`; (the version just before it, the lr applied). With `max_staleness`, a step
        computed on weights `read` at a version more than that many updates old counts for
        less: lr * bound / staleness, the staleness read here, with the version it lands at
        (under the lock, exactly the staleness reported)."""
        with self._held():
            version = self.version()
            if max_staleness is not None and read is not None:
                tau = version - read
                if tau > max_staleness:
                    lr *= max_staleness / tau  # the hard guard: a very stale step counts less
            self.weights.add_(step, alpha=-lr)
            self.counters[worker] += 1
        return version, lr

    def snapshot(self, timeout_s: float | None = None, counted: bool = False) -> Any:
        """A private copy of the weights (for evaluation off the training path, checkpoints);
        with `counted`, (weights, the update counters) read together (exactly so under the
        lock; without it an update may be landing meanwhile)."""
        with self._held(timeout_s):
            if not counted:
                return self.weights.clone()
            counters = self.counters.clone()
            return self.weights.clone(), counters

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
            g = p.grad.to_dense() if p.grad.is_sparse else p.grad  # an Embedding(sparse=True)
            out[offset : offset + n].copy_(g.reshape(-1))
        offset += n
    return out
