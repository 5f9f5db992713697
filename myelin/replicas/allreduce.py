"""The default replica strategy: average gradients and the loss over replicas every step.

When a stage's backwards are done, its gradients and the step's loss go into
asynchronous all-reduces over the stage's data-parallel group (gloo on CPU, NCCL on
GPU), in ~25 MiB buckets of one dtype and device, all in flight at once; then each
bucket is divided by the number of replicas and copied back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from myelin.replicas import Context, Strategy

__all__ = ["AllReduce", "AllReduceReplicas", "average_gradients"]

_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduce:
    """The default: every step, gradients and the loss are averaged over the replicas.

    What the model is: the parameters, identical on every replica after every step.
    """

    name = "allreduce"

    def build(self, ctx: Context) -> Strategy | None:
        """The running strategy on this rank; None with one replica (nothing to agree on)."""
        if ctx.world.dp_group is None:
            return None
        return AllReduceReplicas(
            ctx.world.dp_group, ctx.world.layout.data_parallel, getattr(ctx.world, "waits", None)
        )


class AllReduceReplicas(Strategy):
    """Gradients and loss averaged over `group`, the `replicas` ranks holding this stage."""

    reduces_gradients = True

    def __init__(self, group: Any, replicas: int, waits: Any = None) -> None:
        self.group = group
        self.replicas = replicas
        self.waits = waits  # bounded waits (runtime/bounded.py): a departed peer cannot hang
        self.bytes = 0  # gradient bytes this rank put into all-reduces

    def backwards_done(self, params: list[torch.nn.Parameter], loss: float) -> float:
        """Average the gradients of `params` and the loss over the replicas."""
        self.bytes += sum(p.numel() * p.element_size() for p in params)
        return average_gradients(params, loss, self.group, self.replicas, self.waits)

    def stats(self) -> dict[str, int]:
        return {"global_bytes": self.bytes}

    def eval_loss(self, loss: float) -> float:
        """Average an evaluation loss over the replicas."""
        return average_gradients([], loss, self.group, self.replicas, self.waits)


def average_gradients(
    params: list[torch.nn.Parameter], loss: float, group: Any, replicas: int, waits: Any = None
) -> float:
    """Average gradients and the loss over `group`: asynchronous all-reduces in ~25 MiB
    buckets, all in flight at once. A parameter no replica used keeps grad None. With
    `waits` (runtime/bounded.py) a lost or departed replica raises instead of hanging."""
    had_grad = [p.grad is not None for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    loss_t = torch.tensor([loss], dtype=torch.float64)
    issue = waits.issue if waits is not None else _issue
    works = [(issue(loss_t, group), None, None)]
    for bucket in _buckets([p.grad for p in params]):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        works.append((issue(flat, group), flat, bucket))
    for work, flat, bucket in works:
        if waits is None:
            work.wait()
        else:
            waits.work(work, strict=False)
        if flat is None:
            continue
        flat.div_(replicas)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    for p, had in zip(params, had_grad, strict=True):
        if not had and not p.grad.any():
            p.grad = None  # unused everywhere: leave it to the optimizer to skip
    return float(loss_t.item()) / replicas


def _issue(t: torch.Tensor, group: Any) -> Any:
    return dist.all_reduce(t, group=group, async_op=True)


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, about _BUCKET_BYTES each."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if (
            not out
            or size + nbytes > _BUCKET_BYTES
            or (out[-1][0].dtype, out[-1][0].device)
            != (
                g.dtype,
                g.device,
            )
        ):
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out
