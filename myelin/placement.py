"""This rank's stage of the model: cut out, materialised, on its device, ties kept.

    device, any_cuda = stage_device(config, device, layout)   # before the world is joined

    module, tied = place_stage(model, config, world)

The stage is `config.stages`' contiguous run of layers for this rank (see partition.py).
A model built under `init_empty` (the meta device) is materialised here, each layer from
its own seed, so only this rank's layers are ever allocated. Parameters that several
stages hold (GPT-2's tied embedding and head) get a process group per set of holders,
whose gradients the loop sums every step, and start equal: the first holder's copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from myelin.config import PipelineConfig
from myelin.errors import ConfigError, PartitionError
from myelin.init import is_meta, materialize
from myelin.partition import StageModule, cross_stage_ties, layers_of, stage_module
from myelin.runtime.group import Layout, World, new_groups, pick_device, this_rank
from myelin.runtime.tied import Tied

__all__ = [
    "Tied",
    "check_every_stage_trains",
    "layer_modules",
    "parameter_names",
    "place_stage",
    "stage_device",
    "stage_modules",
]


def stage_modules(model: Any, config: PipelineConfig) -> list[nn.Module]:
    """Every stage's module, as cut from `model` (eager or meta), in stage order."""
    return [stage_module(model, config.stages, s, config.partition) for s in range(config.stages)]


def place_stage(model: Any, config: PipelineConfig, world: World) -> tuple[nn.Module, list[Tied]]:
    """This rank's stage on its device, materialised if built under `init_empty`, with
    the process groups that keep parameters shared across stages equal."""
    cfg = config
    module = stage_module(model, cfg.stages, world.stage, cfg.partition)
    ties = cross_stage_ties(model, cfg.stages, cfg.partition) if cfg.stages > 1 else {}
    order = _parameter_order(model) if ties else {}
    _check_ties_share_a_device_type(cfg, ties)
    names = {
        stages: [(n, order[id(p)]) for n, p in module.named_parameters() if id(p) in ids]
        for stages, ids in ties.items()
        if world.stage in stages
    }
    groups = new_groups(world, list(ties))
    materialized = is_meta(module)
    if materialized:
        if isinstance(module, StageModule):
            materialize(module, model, list(module), module.first_layer)
        else:
            materialize(module, model, _layers_or_whole(model), 0)
    module = module.to(world.device)
    tied = []
    for stages, group in groups.items():
        params = [module.get_parameter(n) for n, _ in names[stages]]
        if materialized:  # each owner initialised its copy: take the first stage's
            src = world.layout.rank_of(stages[0], world.replica)
            for p in params:
                dist.broadcast(p.data, src, group=group)
        tied.append(Tied(group, params, stages, [key for _, key in names[stages]]))
    return module, tied


def stage_device(cfg: PipelineConfig, device: Any, layout: Layout) -> tuple[torch.device, bool]:
    """This rank's device (from `device`, else its stage's entry of `stage_devices`, else
    its GPU or the CPU), and whether any stage computes on a GPU."""
    if cfg.stage_devices is None:
        chosen = pick_device(device)
        return chosen, chosen.type == "cuda"
    if device is not None:
        raise ConfigError(
            f"give device={device!r} or stage_devices={list(cfg.stage_devices)}, not both"
        )
    stage = layout.stage_of(this_rank())
    chosen = pick_device(cfg.stage_devices[stage], f"stage_devices[{stage}]")
    any_cuda = any(torch.device(d).type == "cuda" for d in cfg.stage_devices)
    return chosen, any_cuda


def _check_ties_share_a_device_type(cfg: PipelineConfig, ties: dict) -> None:
    """Tied parameters are summed by one collective, which cannot mix CPU and GPU tensors."""
    if cfg.stage_devices is None:
        return
    for stages in ties:
        kinds = {torch.device(cfg.stage_devices[s]).type for s in stages}
        if len(kinds) > 1:
            raise ConfigError(
                f"stages {list(stages)} share tied parameters but stage_devices puts them on "
                f"{sorted(kinds)}; keep stages that share parameters on one kind of device"
            )


def check_every_stage_trains(model: Any, cfg: PipelineConfig) -> None:
    """fp16 skips a step whose gradients overflow by a vote of every rank, so every stage
    needs parameters to vote with."""
    for s in range(cfg.stages):
        module = stage_module(model, cfg.stages, s, cfg.partition)
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(
                f"precision='fp16': stage {s} has no trainable parameters, but every stage "
                f"votes on skipping steps whose gradients overflow; use another partition or "
                f"precision='bf16'"
            )


def _layers_or_whole(model: Any) -> list[nn.Module]:
    try:
        return layers_of(model)
    except PartitionError:
        return [model]


def _parameter_order(model: Any) -> dict[int, int]:
    """id(parameter) -> its position in the whole model's parameters, the same on every rank."""
    whole = model if isinstance(model, nn.Module) else StageModule(list(model))
    return {id(p): i for i, p in enumerate(whole.parameters())}


def parameter_names(model: Any, config: PipelineConfig, stage: int) -> dict[str, str]:
    """The stage's parameter names (as its module names them) -> their names in the whole
    model, as `model.named_parameters()` gives them (a tied parameter: its first name)."""
    whole = model if isinstance(model, nn.Module) else StageModule(list(model))
    full = {}
    for name, p in whole.named_parameters():
        full.setdefault(id(p), name)
    module = stage_module(model, config.stages, stage, config.partition)
    return {n: full.get(id(p), n) for n, p in module.named_parameters()}


def layer_modules(module: nn.Module) -> list[tuple[int, nn.Module]] | None:
    """(index in the whole model, layer) of each layer a placed stage runs in order. A
    one-stage model that runs its own forward: its `pipeline_layers()`, the layers a split
    would run (so its dropout draws what a split model's would), else None."""
    if isinstance(module, StageModule):
        return module.stream_layers()
    if hasattr(module, "pipeline_layers"):
        return list(enumerate(layers_of(module)))
    return None
