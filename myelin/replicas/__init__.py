"""How the data-parallel replicas of one stage agree: one module per strategy.

The event loop calls a strategy at fixed points of each training step: when the step's
backwards are done (`backwards_done`, which returns the step's loss as the replicas
agree on it), after the optimizer step, and at the step's end. A strategy owns its
state. `allreduce.AllReduce`, gradients averaged every step, is the default.
"""

from __future__ import annotations

import torch

__all__ = ["Strategy"]


class Strategy:
    """The hooks a replica strategy implements; each default does nothing."""

    reduces_gradients = False  # gradients change after the backwards (they cannot stream early)

    def backwards_done(self, params: list[torch.nn.Parameter], loss: float) -> float:
        """Every backward of the step has run on this stage: agree on gradients and loss.

        `params` hold this stage's fp32 gradients in `.grad`: the trainable parameters in
        fp32, their fp32 sums' carriers under half precision (offload/gradients.py)."""
        return loss

    def eval_loss(self, loss: float) -> float:
        """The loss of an evaluation step, as the replicas agree on it."""
        return loss

    def after_optimizer_step(self) -> None:
        """The optimizer has stepped this stage's parameters."""

    def step_end(self) -> None:
        """The step is over on this rank."""
