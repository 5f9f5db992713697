"""How the losses of a step's microbatches make the step's loss.

By default a step's loss is the mean of its microbatches' losses, and each microbatch's
backward runs on its loss / microbatches: gradient accumulation. A `StepLoss` instead
returns each microbatch's *share* of the step's loss, given what it must know of the whole
step (HF's causal LM loss: the step's count of labelled tokens). The shares add up to the
step's loss, so their backward is not divided, and the step's loss does not depend on how
the batch is cut into microbatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StepLoss", "step_loss"]


class StepLoss:
    """A loss whose values on a step's microbatches are shares of the step's loss."""

    def shares(self, targets: Sequence[Any]) -> list[Any]:
        """Each microbatch's target, with what its share needs to know of the whole step."""
        return list(targets)

    def __call__(self, output: Any, target: Any) -> torch.Tensor:  # noqa: D102
        raise NotImplementedError


def step_loss(loss_fn: Any, losses: Sequence[float]) -> float:
    """The step's loss from its microbatches' losses, in microbatch order: their sum for a
    StepLoss, else their mean."""
    total = sum(losses)
    return total if isinstance(loss_fn, StepLoss) else total / len(losses)
