"""What a Trainer gives back when it closes: the hooks it put on the user's model, its
sockets and groups, and the process-wide settings it changed (the device's memory cap,
the collector's freeze, torch's CPU threads). Each part only if the constructor got as far
as making it, so a Trainer whose constructor failed gives back what it had taken too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from myelin import collector
from myelin.precision import forget_exact
from myelin.runtime.group import close_world

if TYPE_CHECKING:
    from myelin.trainer import Trainer

__all__ = ["set_threads", "release"]


def set_threads(threads: int | None, device: torch.device) -> int | None:
    """Give a CPU stage `threads` threads; returns the count before, which `release` puts
    back (torch's setting is the whole process's, and outlives the trainer otherwise)."""
    if threads is None or device.type != "cpu":
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    return before


def release(trainer: Trainer) -> None:
    """Undo what `trainer` took, last to first where it matters."""
    streams = getattr(trainer, "streams", None)
    if streams is not None:
        streams.close()  # the layers' pre-hooks, on the user's modules
    memory, loop = getattr(trainer, "_memory", None), getattr(trainer, "loop", None)
    hooked = [memory.activations, memory.updater] if memory is not None else []
    for part in [*hooked, loop.ties if loop is not None else None]:  # on modules and params
        if part is not None:
            part.close()
    if getattr(trainer, "module", None) is not None:
        forget_exact(trainer.module)  # frozen weights' exact values (precision.keep_exact)
    if getattr(trainer, "replicas", None) is not None:
        trainer.replicas.close()
    if trainer.liveness is not None:
        trainer.liveness.close()
    if trainer.transport is not None:
        trainer.transport.close()
    close_world(trainer.world, trainer.liveness is not None and trainer.liveness.lost is not None)
    if getattr(trainer, "budget", None) is not None:
        trainer.budget.close()
    collector.unfreeze(getattr(trainer, "_froze", False))
    threads = getattr(trainer, "_threads_before", None)
    if threads is not None:
        torch.set_num_threads(threads)
    # Last: a launcher's SIGTERM while closing still raises the lost peer's name.
    trainer._failures.release_sigterm()
    # The failure, kept to tell peers and to refuse later steps, holds the trainer through
    # its traceback's frames: let it go, so the error is the user's alone to keep or drop.
    trainer._failures.failed = None
    if trainer.liveness is not None:
        trainer.liveness.failed = None
