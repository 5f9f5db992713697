"""Models too large for one process: build on the meta device, materialise stage by stage.

    with myelin.init_empty():
        model = GPT(GPTConfig(n_layer=96))        # no memory: parameters are on "meta"
    trainer = myelin.Trainer(model, ...)          # each rank allocates only its own stage

Each layer is initialised from its own seed (`seed + layer index`), so a rank's
weights do not depend on which other layers it holds, and `init_layers` gives an
eager model exactly the weights the meta path would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["init_empty", "init_layers", "materialize", "is_meta"]


@contextlib.contextmanager
def init_empty() -> Iterator[None]:
    """Create modules under this context on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        yield


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is still on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def init_layer(model: object, index: int, layer: nn.Module, seed: int = 0) -> None:
    """Initialise pipeline layer `index` of `model` deterministically from `seed + index`.

    Uses the model's own `init_layer(index, layer)` if it has one (myelin's GPT does),
    else HuggingFace's `_init_weights(module)`, else each submodule's `reset_parameters()`.
    """
    own = getattr(model, "init_layer", None)
    if callable(own):
        own(index, layer)
        return
    hf_init = getattr(model, "_init_weights", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + index)
        for sub in layer.modules():
            if callable(hf_init):
                hf_init(sub)
            elif hasattr(sub, "reset_parameters"):
                sub.reset_parameters()


def init_layers(model: object, layers: Sequence[nn.Module], seed: int = 0) -> None:
    """Initialise every layer of an eager model as the meta path would.

    Layers go last to first, so a parameter shared by several layers (a tied embedding)
    keeps the initialisation of the first layer holding it, as the meta path keeps it.
    """
    for i in reversed(range(len(layers))):
        init_layer(model, i, layers[i], seed)


def materialize(
    module: nn.Module, model: object, layers: Sequence[nn.Module], first: int, seed: int = 0
) -> nn.Module:
    """Allocate `module` (this rank's stage, holding `layers` from index `first`) on the CPU
    and initialise it; parameters shared inside the stage stay shared."""
    shared: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    module.to_empty(device="cpu")
    for names in shared.values():
        keep = module.get_parameter(names[0])
        for name in names[1:]:
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent), leaf, keep)
    for i in reversed(range(len(layers))):  # the first holder of a shared parameter wins
        init_layer(model, first + i, layers[i], seed)
    return module
