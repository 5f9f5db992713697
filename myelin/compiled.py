"""A model given as `torch.compile(model)`: split as the model it wraps, and each stage
compiles its own layers, one by one, under the settings the user gave (backend, mode...).

Compiling layer by layer (as torchtitan does) keeps what runs between them eager: the
stage's plumbing, and for a HuggingFace model its own forward with the stand-ins of the
layers another stage holds; a whole-model graph would be cut at every one of them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from myelin.layers import StageModule

__all__ = ["compile_stage", "unwrap"]


def unwrap(model: Any) -> tuple[Any, Callable | None]:
    """(the model `torch.compile` wrapped, how to compile a layer as it would), or
    (model, None) for a model that was not compiled."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None or not isinstance(model, dynamo.OptimizedModule):
        return model, None
    context = getattr(model, "dynamo_ctx", None)  # the user's backend, mode, dynamic...

    def compile_layer(layer: nn.Module) -> None:
        if context is None:
            layer.compile()
        else:  # what nn.Module.compile does, with the user's settings
            layer._compiled_call_impl = context(layer._call_impl)

    return model._orig_mod, compile_layer


def compile_stage(module: nn.Module, compile_layer: Callable[[nn.Module], None]) -> None:
    """Compile a stage's layers in place (a HuggingFace stage: its blocks)."""
    if getattr(module, "whole", None) is not None:  # myelin.hf.HFStage
        blocks = {id(b) for b in module.whole.found.blocks}
        layers = [layer for layer in module if id(layer) in blocks]
    elif isinstance(module, StageModule):
        layers = list(module)
    else:
        layers = [module]
    for layer in layers:
        compile_layer(layer)
