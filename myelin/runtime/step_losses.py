"""A step's loss from its microbatches' losses: read from the device once, averaged by rows.

The last stage holds its microbatch losses as tensors until its last backward of the step,
then reads them in one transfer (on a GPU one wait a step, not one a microbatch) and sends
them, as floats, with that gradient (`meta.losses`); every other stage takes them from there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from myelin.errors import MyelinError

__all__ = ["as_floats", "mean_loss"]


def as_floats(losses: dict[int, Any], microbatches: int, where: str) -> dict[int, float]:
    """Every microbatch's loss as a float, the tensors among them read in one transfer;
    `where` ("rank 1 (stage 1): step 3") names the step if some are missing."""
    if sorted(losses) != list(range(microbatches)):
        raise MyelinError(
            f"{where} has the losses of microbatches {sorted(losses)} of {microbatches}; the "
            f"next stage sends them all with the step's last gradient"
        )
    own = [i for i, v in losses.items() if isinstance(v, torch.Tensor)]
    read = torch.stack([losses[i].double().reshape(()) for i in own]).tolist() if own else []
    return {i: float(v) for i, v in {**losses, **dict(zip(own, read))}.items()}


def mean_loss(
    losses: dict[int, float],
    rows: dict[int, int],
    microbatches: int,
    step_loss: Callable[[list[float]], float] | None = None,
) -> float:
    """The step's loss: the mean, by rows if the batch split unevenly; `step_loss` (a
    StepLoss's, whose microbatch losses are shares of the step's) combines them itself."""
    m = microbatches
    if step_loss is not None:
        return step_loss([losses[i] for i in range(m)])
    rows = rows or dict.fromkeys(range(m), 1)  # x * 1 and the count are exact
    return sum(losses[i] * rows[i] for i in range(m)) / sum(rows[i] for i in range(m))
