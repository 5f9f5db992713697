"""A trainer of one rank forgets a step that failed before its optimizer update began.

What the step changed on its way is put back (its activations and partial gradients
dropped; running statistics, the layers' random streams, the loss scale and the state of
each `myelin.nn.LSHSoftmax`, its step count, tables and generators, as they were),
so the next step trains as if the failed one had never been called, and a bad input or a
Ctrl-C in a notebook costs nothing. With several ranks a failed step still breaks the
pipeline: the peers are mid-step, and abandoning a step together is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from myelin.nn.layer import LSHSoftmax

__all__ = ["Savepoint", "forget_step", "savepoint", "stateful_layers"]


@dataclass(slots=True)
class Savepoint:
    """What a one-rank step may change before its update."""

    stats: list[tuple[torch.Tensor, torch.Tensor]]  # (a running statistic, its value)
    streams: Any  # runtime/rng.LayerStreams.mark()
    scale: dict[str, Any] | None  # the fp16 loss scaler's state
    lsh: list[tuple[LSHSoftmax, Any]]  # (a layer, its LSHSoftmax.savepoint())


def savepoint(trainer: Any) -> Savepoint | None:
    """Taken before a step of a trainer of one rank (None with several: nothing to retry).
    Cheap: the norm layers' running statistics and the LSH layers' moved marks and
    generator states are copied, the rest is a few references."""
    if trainer.world.layout.world_size != 1:
        return None
    if trainer.stateful_layers is None:  # found once: a walk of the module tree costs
        trainer.stateful_layers = stateful_layers(trainer.module)
    layers = trainer.stateful_layers
    stats = [
        (b, b.clone())
        for m in layers
        if isinstance(m, _NormBase) and m.track_running_stats
        for b in m.buffers(recurse=False)
    ]
    scaler = getattr(trainer.updater, "scaler", None)
    scale = scaler.state_dict() if scaler is not None else None
    lsh = [(m, m.savepoint()) for m in layers if isinstance(m, LSHSoftmax)]
    return Savepoint(stats, trainer.streams.mark(), scale, lsh)


def stateful_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of `module` whose state a training step changes before its update: norm
    layers' running statistics; an `LSHSoftmax`'s step count, moved marks, generators and,
    now and then, its tables."""
    return [m for m in module.modules() if isinstance(m, _NormBase | LSHSoftmax)]


def forget_step(trainer: Any, saved: Savepoint | None, exc: BaseException, training: bool) -> bool:
    """Drop what a failed step left (activations, partial gradients) so the next starts
    clean, and put back what it changed; True when it could (one rank, an Exception or
    Ctrl-C, its update not begun), so the trainer stays usable with its model unchanged."""
    if saved is None or not isinstance(exc, Exception | KeyboardInterrupt):
        return False
    loop = trainer.loop
    updater = loop.updater
    unchanged = not training or updater is None or not updater.changed
    loop.stage.clear()
    if loop.ties is not None:
        loop.ties.clear()
    if updater is not None and training:
        updater.zero_grad()
    if loop.budget is not None:
        loop.budget.set("gradients", 0, "")
    if unchanged:
        with torch.no_grad():
            for live, value in saved.stats:
                live.copy_(value)
            for layer, state in saved.lsh:
                layer.restore(state)
        trainer.streams.rewind(saved.streams)
        if saved.scale is not None:
            updater.scaler.load_state_dict(saved.scale)
    return unchanged
