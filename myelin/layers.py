"""A pipeline stage's layers as one module: run in order, tuples passed on as arguments."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

__all__ = ["StageModule", "evaluating"]


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """`module` in eval mode while open; after, each submodule's own mode as it was (a
    BatchNorm frozen with `.eval()` stays frozen)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        module.train(modes[0][1])  # first, so overrides run (an HF stage's whole model)
        for m, training in modes:
            m.training = training


class StageModule(nn.Sequential):
    """Layers run in order; a layer that returns a tuple passes it on as separate arguments,
    and the last layer's return value is the stage's, as it returned it.

    `first_layer` is the index of its first layer in the whole model.
    """

    def __init__(self, layers: Sequence[nn.Module], first_layer: int = 0) -> None:
        super().__init__(*layers)
        self.first_layer = first_layer

    def forward(self, *args):  # noqa: D102
        out = args[0] if len(args) == 1 else args
        for layer in self:
            out = layer(*args)
            args = out if isinstance(out, tuple) else (out,)
        return out  # the last layer's own value: on the last stage, what loss_fn gets

    def stream_layers(self) -> list[tuple[int, nn.Module]]:
        """(index in the whole model, module) pairs whose forward starts that layer's random
        stream (runtime/rng.py): each layer itself; a stage that runs its layers' modules
        some other way names those modules instead, several under one index if need be."""
        return [(self.first_layer + i, layer) for i, layer in enumerate(self)]
