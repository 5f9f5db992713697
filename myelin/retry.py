"""A trainer of one rank forgets a step that failed before its optimizer update began.

What the step changed on its way is put back (its activations and partial gradients
dropped; running statistics, the layers' random streams and the loss scale as they were),
so the next step trains as if the failed one had never been called, and a bad input or a
Ctrl-C in a notebook costs nothing. With several ranks a failed step still breaks the
pipeline: the peers are mid-step, and abandoning a step together is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Savepoint", "forget_step", "norm_layers", "savepoint"]


@dataclass(slots=True)
class Savepoint:
    """What a one-rank step may change before its update."""

    stats: list[tuple[torch.Tensor, torch.Tensor]]  # (a running statistic, its value)
    streams: Any  # runtime/rng.LayerStreams.mark()
    scale: dict[str, Any] | None  # the fp16 loss scaler's state


def savepoint(trainer: Any) -> Savepoint | None:
    """Taken before a step of a trainer of one rank (None with several: nothing to retry).
    Cheap: the norm layers' running statistics are copied, the rest is a few references."""
    if trainer.world.layout.world_size != 1:
        return None
    if trainer.norm_layers is None:  # found once: a walk of the module tree costs every step
        trainer.norm_layers = norm_layers(trainer.module)
    stats = [
        (b, b.clone())
        for m in trainer.norm_layers
        if m.track_running_stats
        for b in m.buffers(recurse=False)
    ]
    scaler = getattr(trainer.updater, "scaler", None)
    scale = scaler.state_dict() if scaler is not None else None
    return Savepoint(stats, trainer.streams.mark(), scale)


def norm_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of `module` with running statistics a failed step may have changed."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]


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
        trainer.streams.rewind(saved.streams)
        if saved.scale is not None:
            updater.scaler.load_state_dict(saved.scale)
    return unchanged
