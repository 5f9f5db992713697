"""HuggingFace's own causal LM loss, as each microbatch's share of the step's loss.

Labels are given as HF takes them: not shifted (the loss shifts them; position t predicts
label t+1) and -100 where a token is not to be predicted (padding). A microbatch's share is
its summed token losses over the count of labelled tokens in the whole step, computed by
the model's own `loss_function` with `num_items_in_batch`, as HF's Trainer does under
gradient accumulation. So the shares add up to the loss HF's forward gives on the whole
batch, however the batch is cut into microbatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from myelin.errors import ConfigError
from myelin.hf.shape import is_hf_model
from myelin.losses import StepLoss

__all__ = ["CausalLMLoss", "labelled", "own_loss"]

IGNORE = -100


class CausalLMLoss(StepLoss):
    """`model.loss_function` on a microbatch's logits and labels, over the step's count."""

    def __init__(self, model: nn.Module) -> None:
        self.loss_function = model.loss_function
        self.vocab_size = model.config.vocab_size

    def shares(self, targets: Sequence[Any]) -> list[tuple[torch.Tensor, int]]:
        """Each microbatch's labels, with the count of labelled tokens in the whole step."""
        count = sum(labelled(t) for t in targets)
        return [(t, count) for t in targets]

    def __call__(self, logits: torch.Tensor, target: tuple[torch.Tensor, int]) -> torch.Tensor:  # noqa: D102
        labels, count = target
        return self.loss_function(
            logits=logits, labels=labels, vocab_size=self.vocab_size, num_items_in_batch=count
        )


def own_loss(model: nn.Module) -> CausalLMLoss:
    """The loss a model brings with it: a HuggingFace causal LM's own; others bring none."""
    if not is_hf_model(model):
        raise ConfigError(
            f"loss_fn=None: a {type(model).__name__} needs a callable loss_fn(output, target) "
            f"-> scalar tensor; only a HuggingFace causal LM brings its own"
        )
    return CausalLMLoss(model)


def labelled(labels: Any) -> int:
    """The tokens of `labels` (batch, tokens) that a causal LM loss counts: all but each
    row's first (nothing predicts it) and those set to -100."""
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dim() < 1:
        raise ConfigError(
            f"labels for a HuggingFace causal LM must be an integer tensor (batch, tokens), "
            f"the input_ids with -100 where nothing is to be predicted; got "
            f"{type(labels).__name__ if not isinstance(labels, torch.Tensor) else labels.dtype}"
        )
    return int((labels[..., 1:] != IGNORE).sum())
