"""Split a model into contiguous pipeline stages.

A model is a sequence of layers: an `nn.Sequential`, a list of modules, any
module with a `pipeline_layers()` method returning such a list (as
`myelin.models.GPT` does), or a HuggingFace causal LM, whose layers are
[embeddings, blocks..., head] and whose stages run its own forward (`myelin.hf`).
Stages are balanced by parameter count (each layer counts at least one, so
parameter-free layers spread too), or follow an explicit layer count per stage,
`partition=[layers of stage 0, layers of stage 1, ...]`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from myelin import hf
from myelin.errors import PartitionError
from myelin.layers import StageModule

__all__ = [
    "StageModule",
    "layers_of",
    "balance",
    "split",
    "stage_module",
    "tied_parameters",
    "cross_stage_ties",
]


def layers_of(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The model as an ordered list of layers, or a PartitionError saying how to make one."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, (list, tuple, nn.ModuleList)):
        layers = list(model)
    elif hasattr(model, "pipeline_layers"):
        layers = list(model.pipeline_layers())
    elif hf.is_hf_model(model):
        layers = hf.layers_of(model)
    else:
        raise PartitionError(
            f"cannot split a {type(model).__name__} into stages: pass an nn.Sequential, a list "
            "of modules, a module with a pipeline_layers() method returning its layers in "
            "order, or a HuggingFace causal LM"
        )
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise PartitionError(f"layer {i} is a {type(layer).__name__}, not an nn.Module")
    return layers


def balance(weights: Sequence[int], stages: int) -> list[int]:
    """Layer counts per stage: contiguous cuts closest to equal shares of `weights`."""
    n = len(weights)
    if stages < 1:
        raise PartitionError(f"stages={stages} must be at least 1")
    if n < stages:
        raise PartitionError(
            f"cannot split {n} layers into {stages} stages: each stage needs at least one layer"
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total = prefix[-1]
    cuts = [0]
    for k in range(1, stages):
        lo, hi = cuts[-1] + 1, n - (stages - k)
        target = total * k / stages
        cuts.append(min(range(lo, hi + 1), key=lambda c: (abs(prefix[c] - target), c)))
    cuts.append(n)
    return [cuts[i + 1] - cuts[i] for i in range(stages)]


def split(
    model: nn.Module | Sequence[nn.Module],
    stages: int,
    partition: Sequence[int] | None = None,
) -> list[list[nn.Module]]:
    """Split the model's layers into `stages` contiguous groups."""
    layers = layers_of(model)
    if hasattr(model, "pipeline_layers") and (stages > 1 or partition is not None):
        _check_nothing_outside(model, layers)  # (an nn.Sequential's layers hold it all)
    if partition is None:
        counts = balance([max(1, _params(layer)) for layer in layers], stages)
    else:
        counts = list(partition)
        if len(counts) != stages:
            raise PartitionError(
                f"partition={counts} lists {len(counts)} stages, but stages={stages}"
            )
        if any(type(c) is not int or c < 1 for c in counts):
            raise PartitionError(f"partition={counts}: every stage needs an int >= 1 layers")
        if sum(counts) != len(layers):
            raise PartitionError(
                f"partition={counts} covers {sum(counts)} layers, but the model has {len(layers)}"
            )
    out, start = [], 0
    for c in counts:
        out.append(layers[start : start + c])
        start += c
    return out


def stage_module(
    model: nn.Module | Sequence[nn.Module],
    stages: int,
    index: int,
    partition: Sequence[int] | None = None,
) -> nn.Module:
    """The module that stage `index` runs: the whole model for one stage, else its layers."""
    if not 0 <= index < stages:
        raise PartitionError(f"stage index {index} is out of range of {stages}")
    if stages == 1 and partition is None and isinstance(model, nn.Module):
        if not isinstance(model, (nn.Sequential, nn.ModuleList)) and not hf.is_hf_model(model):
            return model  # one stage runs the model's own forward
    groups = split(model, stages, partition)
    first = sum(len(g) for g in groups[:index])
    if hf.is_hf_model(model):
        return hf.HFStage(model, groups[index], first)
    return StageModule(groups[index], first_layer=first)


def _check_nothing_outside(model: nn.Module, layers: Sequence[nn.Module]) -> None:
    """Stages run only the layers: a parameter or saved buffer the model holds outside
    them would be neither trained nor saved, so it is named instead."""
    held = {id(t) for layer in layers for t in layer.state_dict(keep_vars=True).values()}
    inside = {id(m) for layer in layers for m in layer.modules()}

    def out(key: str, t: object) -> bool:
        if key.endswith("_extra_state"):  # made anew by each state_dict(): by its module
            return id(model.get_submodule(key.rpartition(".")[0])) not in inside
        return id(t) not in held

    outside = [k for k, t in model.state_dict(keep_vars=True).items() if out(k, t)]
    if outside:
        shown = ", ".join(outside[:5]) + (
            f" and {len(outside) - 5} more" if len(outside) > 5 else ""
        )
        raise PartitionError(
            f"{type(model).__name__} holds {shown} outside every layer of its "
            f"pipeline_layers(): stages run only those layers, so this state would be "
            f"neither trained nor saved; move it into a layer (or, for a buffer nothing "
            f"needs saved, register it with persistent=False)"
        )


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def tied_parameters(layers: Sequence[nn.Module]) -> dict[int, list[int]]:
    """Parameters shared by several layers: id(parameter) -> the layers holding it."""
    owners: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        for p in {id(p) for p in layer.parameters()}:
            owners.setdefault(p, []).append(i)
    return {p: ls for p, ls in owners.items() if len(ls) > 1}


def cross_stage_ties(
    model: nn.Module | Sequence[nn.Module], stages: int, partition: Sequence[int] | None = None
) -> dict[tuple[int, ...], set[int]]:
    """Parameters held by more than one stage (GPT-2's embedding and LM head):
    the stages sharing them -> the ids of the shared parameters."""
    groups = split(model, stages, partition)
    stage_of = [s for s, g in enumerate(groups) for _ in g]
    ties: dict[tuple[int, ...], set[int]] = {}
    for pid, layers in tied_parameters([layer for g in groups for layer in g]).items():
        owners = tuple(sorted({stage_of[i] for i in layers}))
        if len(owners) > 1:
            ties.setdefault(owners, set()).add(pid)
    return ties
