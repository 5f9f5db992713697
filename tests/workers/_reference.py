"""Plain PyTorch in one process, doing what myelin promises to equal: gradient accumulation
over microbatches, in half precision with fp32 master weights and fp32 gradient sums, with
clip_grad_norm_ over the whole model. Shared by the parity tests and their workers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mlp(seed=0) -> nn.Sequential:
    """The parity tests' small model: Linear, Tanh, LayerNorm, Linear, Tanh, Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.Tanh(),
        nn.LayerNorm(32),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def batches(n, rows=16, seed=0) -> list:
    """`n` seeded (inputs, class labels) batches for `mlp`."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g))
        for _ in range(n)
    ]


def chunks(batch, microbatches: int) -> list:
    """A batch (tensor or tuple of tensors) as `microbatches` pieces, as Trainer.step splits
    it: equal pieces, or (a short last batch) pieces whose sizes differ by at most one."""
    if isinstance(batch, list):
        return batch
    if isinstance(batch, tuple):
        parts = [t.tensor_split(microbatches) for t in batch]
        return [tuple(p[i] for p in parts) for i in range(microbatches)]
    return list(batch.tensor_split(microbatches))


def rows(piece) -> int:
    return (piece[0] if isinstance(piece, tuple) else piece).shape[0]


def train(
    model: nn.Module,
    factory: Callable,
    loss_fn: Callable,
    batches: Sequence[tuple],
    microbatches: int,
    *,
    precision: str = "fp32",
    max_grad_norm: float | None = None,
    loss_scale: float | None = None,
    scheduler: Callable | None = None,
) -> tuple[list[float], list[torch.Tensor], torch.optim.Optimizer]:
    """Train `model` on `batches` of (inputs, targets); returns the step losses, the fp32
    weights the optimizer steps (masters under half precision) and the optimizer.

    Each microbatch's loss counts by its share of the batch's rows: divided by m for equal
    pieces (as myelin divides), times rows/total for a short last batch split unevenly."""
    dtype = DTYPES[precision]
    params = [p for p in model.parameters() if p.requires_grad]
    if dtype == torch.float32:
        masters = params
    else:
        masters = [nn.Parameter(p.detach().clone().float()) for p in params]
        model.to(dtype)
    opt = factory(masters)
    sched = scheduler(opt) if scheduler is not None else None
    losses = []
    for inputs, targets in batches:
        xs, ys = chunks(inputs, microbatches), chunks(targets, microbatches)
        total = sum(rows(y) for y in ys)
        even = len({rows(y) for y in ys}) == 1
        sums: list[torch.Tensor | None] = [None] * len(params)
        mb_losses = []
        for x, y in zip(xs, ys):
            x = tuple(x) if isinstance(x, tuple) else (x,)
            x = tuple(t.to(dtype) if t.is_floating_point() else t for t in x)
            out = model(*x)
            loss = loss_fn(out.float() if dtype != torch.float32 else out, y)
            share = rows(y) / total
            scaled = loss / microbatches if even else loss * share
            if loss_scale is not None:
                scaled = scaled * loss_scale
            scaled.backward()
            mb_losses.append(loss.item() if even else loss.item() * rows(y))
            if dtype != torch.float32:  # sum each microbatch's gradient in fp32
                for i, p in enumerate(params):
                    if p.grad is not None:
                        sums[i] = p.grad.float() if sums[i] is None else sums[i].add_(p.grad)
                        p.grad = None
        if dtype != torch.float32:
            for m, s in zip(masters, sums):
                m.grad = s
            if loss_scale is not None:
                torch._foreach_mul_([m.grad for m in masters if m.grad is not None], 1 / loss_scale)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if dtype != torch.float32:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        losses.append(sum(mb_losses) / (microbatches if even else total))
    return losses, [m.detach() for m in masters], opt
