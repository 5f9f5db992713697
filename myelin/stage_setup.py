"""What one rank makes of the user's model before training: its stage cut out, loaded,
compiled and placed, its parameters' names in the whole model, the fp32 values its masters
start from, and the global-norm clip that spans every stage."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from myelin import compiled, pretrained, whole
from myelin.config import PipelineConfig
from myelin.errors import ConfigError
from myelin.hf.keys import saved_renames
from myelin.placement import Tied, parameter_names, place_stage, stage_modules
from myelin.precision import compute_dtype, keep_exact
from myelin.reshard import stage_keys
from myelin.runtime.clip import GlobalNorm, norm_slots
from myelin.runtime.group import World, new_groups

__all__ = ["PreparedStage", "prepare_stage"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PreparedStage:
    module: nn.Module  # this rank's stage, on its device, in the compute dtype
    tied: list[Tied]  # parameters this stage shares with other stages
    state_layout: Any  # the whole model's state_dict keys by stage (whole.state_layout)
    stage_layers: list[Any]  # each stage's layers, which checkpoints move between layouts
    names: list[str]  # the trainable parameters' names in the whole model
    frozen: list[tuple[str, nn.Parameter]]  # (name in the whole model, parameter) of the rest
    initial: list[torch.Tensor] | None  # fp32 starting values of half-precision masters
    clip: GlobalNorm | None
    dtype: torch.dtype


def prepare_stage(
    model: Any,
    cfg: PipelineConfig,
    world: World,
    *,
    precision: str,
    max_grad_norm: float | None,
    weights: Any,
    compile_layer: Any,
) -> PreparedStage:
    """Cut, load (`weights`: a save_pretrained folder), compile and place this rank's stage."""
    stages = stage_modules(model, cfg)
    state_layout = whole.state_layout(model, stages)
    local_names = parameter_names(model, cfg, world.stage)
    clip = None
    if max_grad_norm is not None:
        clip = _global_norm(max_grad_norm, model, stages, world, cfg.sync)
    full = pretrained.full_names(model, stages[world.stage]) if weights else None
    module, tied = place_stage(model, cfg, world)
    if full is not None:
        pretrained.load(module, full, weights, saved_renames(model))
    if compile_layer is not None:
        compiled.compile_stage(module, compile_layer)
    dtype = compute_dtype(precision)
    trainable = [p for p in module.parameters() if p.requires_grad]
    names = [local_names[n] for n, p in module.named_parameters() if p.requires_grad]
    frozen = [(local_names[n], p) for n, p in module.named_parameters() if not p.requires_grad]
    # Masters start from the fp32 weights, not from their half-precision rounding.
    initial = [p.detach().clone() for p in trainable] if dtype != torch.float32 else None
    if any(p.dtype == torch.float64 for p in module.parameters()):
        log.warning(
            "rank %d: the model's float64 parameters train as %s (precision=%r): myelin's "
            "precisions are fp32, bf16 and fp16",
            world.rank,
            dtype,
            precision,
        )
    norms = {id(p) for m in module.modules() if isinstance(m, _NORMS) for p in m.parameters()}
    for p in module.parameters():  # a frozen weight that the cast rounds: kept exact
        keep_exact(p, p, torch.float32 if id(p) in norms else dtype)  # (BatchNorm stays fp32)
    _cast(module, dtype)
    layers = [stage_keys(m).layers for m in stages]
    return PreparedStage(module, tied, state_layout, layers, names, frozen, initial, clip, dtype)


def check_still_frozen(frozen: list[tuple[str, nn.Parameter]], rank: int) -> None:
    """Raise if a parameter frozen when the trainer was built trains now: it has no slot
    in the optimizer (nor a master, nor a gradient sum), so it would never change."""
    thawed = [name for name, p in frozen if p.requires_grad]
    if thawed:
        raise ConfigError(
            f"rank {rank}: {len(thawed)} parameter(s) frozen when the Trainer was built now "
            f"have requires_grad=True ({', '.join(thawed[:3])}{', ...' if len(thawed) > 3 else ''}"
            f"), but the optimizer was built over the parameters that trained then, so they "
            f"would never change. Unfreeze before building the Trainer (a parameter frozen "
            f"later is skipped, as torch's optimizers skip it), or save, unfreeze and build "
            f"a new Trainer from the checkpoint"
        )


_NORMS = nn.modules.batchnorm._BatchNorm  # kept in fp32 under half precision (`_cast`)


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    """`module.to(dtype)`, but BatchNorm layers keep their fp32 weights and running
    statistics (as under autocast; in half precision a running mean stops moving once its
    updates fall under its rounding), their values untouched."""
    norms = [m for m in module.modules() if isinstance(m, _NORMS)]
    kept = [{k: v.detach().float().clone() for k, v in m.state_dict().items()} for m in norms]
    module.to(dtype)
    for m, state in zip(norms, kept, strict=True):
        m.float()
        m.load_state_dict(state)


def _global_norm(
    max_norm: float, model: Any, stages: list[Any], world: World, sync: Any
) -> GlobalNorm:
    """The clip of this rank's stage. Under AllReduce every replica applies the same
    averaged gradient: replica 0's norms, summed over the world, stand for all. Where each
    replica applies its own gradient (`sync.own_gradients`: EASGD, whose gradients are
    never averaged; DASO, whose are at most averaged inside a node, so equal there), each
    replica clips by the norm of its own, as clip_grad_norm_ in its own process would:
    over its pipeline ranks only, and without any collective when it has one stage."""
    order = list(model.parameters()) if isinstance(model, nn.Module) else ()
    slots, total = norm_slots(stages, world.stage, order)
    if not getattr(sync, "own_gradients", False):
        return GlobalNorm(max_norm, slots, total, counts=world.replica == 0, device=world.device)
    stage_count = world.layout.stages
    group = None
    if stage_count > 1:  # every rank makes every replica's group, in the same order
        group = new_groups(world, [tuple(range(stage_count))])[tuple(range(stage_count))]
    one = stage_count == 1
    return GlobalNorm(
        max_norm, slots, total, counts=True, device=world.device, group=group, alone=one
    )
