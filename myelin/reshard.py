"""What a rank's checkpoint shard holds, by layer, so a checkpoint loads into any layout.

Every tensor is saved under its key in the whole model's numbering of layers: "3.weight"
is `weight` of layer 3, whichever stage held it. A rank that loads finds its layers in the
shards of the stages that held them (in its own replica, or replica 0's when the run had
fewer replicas) and reads only those. What moves:

- the stage's weights, as the fp32 masters under half precision (the values the optimizer
  steps, which the half-precision weights round);
- the optimizer's state per parameter and its groups' settings (each new group takes the
  settings of the group its parameters were in), and fp16's loss scale;
- the layers' random streams (`runtime/rng.py`), replica by replica;
- the LR scheduler, the RNG state of the process, the user's `extra` and the step counters,
  from the shard that held the stage's first layer.

What cannot move is said in a warning: random streams of a replica the checkpoint did not
have, or of a one-stage model that ran its own forward (one stream, not one per layer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from myelin.errors import CheckpointError, MyelinError, PartitionError
from myelin.partition import StageModule, layers_of
from myelin.precision import exact_value, keep_exact

__all__ = [
    "ReshardError",
    "StageKeys",
    "capture",
    "export",
    "layer_weights",
    "restore",
    "scheduler_state",
]

log = logging.getLogger(__name__)

_NOT_HYPER = ("params", "param_names")  # group entries that are not the group's settings


class ReshardError(MyelinError):
    """A checkpoint's contents do not fit the model or layout they are loaded into."""


@dataclass(frozen=True, slots=True)
class StageKeys:
    """A stage's state_dict keys as layer keys, and the layers it holds ([first, end))."""

    keys: dict[str, str]  # local key -> layer key
    layers: tuple[int, int] | None  # None: not split into layers (keys stay the model's)


def stage_keys(module: nn.Module) -> StageKeys:
    """The layer key of each of `module`'s state_dict entries (see the module docstring)."""
    local = module.state_dict(keep_vars=True)
    if isinstance(module, StageModule):
        first = module.first_layer
        keys = {}
        for k in local:
            index, rest = k.split(".", 1)
            keys[k] = f"{first + int(index)}.{rest}"
        return StageKeys(keys, (first, first + len(module)))
    try:
        layers = layers_of(module)
    except PartitionError:
        return StageKeys({k: k for k in local}, None)
    holders: dict[int, list[str]] = {}  # a tensor (tied: several layers) -> its layer keys
    for i, layer in enumerate(layers):
        for k, t in layer.state_dict(keep_vars=True).items():
            holders.setdefault(id(t), []).append(f"{i}.{k}")
    keys = {}
    for k, t in local.items():
        found = holders.get(id(t))
        if not found:  # state outside every layer: keep the model's own keys
            return StageKeys({k: k for k in local}, None)
        keys[k] = found.pop(0)
    return StageKeys(keys, (0, len(layers)))


def export(module: nn.Module, updater: Any) -> dict[str, torch.Tensor]:
    """The stage's state_dict with each trainable parameter's fp32 master in its place where
    one exists (half precision, optimizer offload), and each frozen one's exact value where
    half precision rounded it (precision.keep_exact): the stage's true weights."""
    state = module.state_dict()
    masters = updater.master_weights() if updater is not None else {}
    held = module.state_dict(keep_vars=True)  # a frozen weight: its exact value if kept
    return {k: masters.get(id(held[k]), exact_value(held[k], v)) for k, v in state.items()}


def layer_weights(
    module: nn.Module, updater: Any = None, sk: StageKeys | None = None
) -> dict[str, torch.Tensor]:
    """The stage's weights by layer key (`sk`, found when not given), copied to the CPU
    (`export`'s: fp32 masters in place where the updater has them)."""
    sk = sk or stage_keys(module)
    return {sk.keys[k]: v.detach().cpu().clone() for k, v in export(module, updater).items()}


def capture(
    module: nn.Module,
    updater: Any,
    streams: Any,
    scheduler: Any,
) -> dict[str, Any]:
    """The stage's weights, optimizer state, random streams and scheduler by layer key."""
    sk = stage_keys(module)
    weights = layer_weights(module, updater, sk)
    optimizer = None
    if updater is not None:
        keys_of = _param_keys(module, sk)
        sd = updater.state_dict()
        torch_sd = sd["optimizer"]
        order = [p for g in updater.optimizer.param_groups for p in g["params"]]
        param_of_master = {id(m): p for p, m in zip(updater.params, updater.masters, strict=True)}
        params, groups = [], []
        index = 0
        for g, group in enumerate(torch_sd["param_groups"]):
            groups.append({k: v for k, v in group.items() if k not in _NOT_HYPER})
            for _ in group["params"]:
                master = order[index]
                p = param_of_master.get(id(master), master)
                params.append(
                    {
                        "keys": keys_of.get(id(p), []),
                        "state": torch_sd["state"].get(index, {}),
                        "group": g,
                    }
                )
                index += 1
        optimizer = {
            "kind": _kind(updater.optimizer),
            "params": params,
            "groups": groups,
            "loss_scale": sd["loss_scale"],
        }
    return {
        "layers": list(sk.layers) if sk.layers is not None else None,
        "model": weights,
        "optimizer": optimizer,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "lr_scheduler_kind": _kind(scheduler) if scheduler is not None else None,
        "streams": streams.state_dict()["streams"] if streams is not None else {},
    }


def _param_keys(module: nn.Module, sk: StageKeys) -> dict[int, list[str]]:
    """id(parameter) -> its layer keys (several when layers of the stage share it)."""
    out: dict[int, list[str]] = {}
    for k, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, nn.Parameter):
            out.setdefault(id(t), []).append(sk.keys[k])
    return out


def restore(
    module: nn.Module,
    updater: Any,
    streams: Any,
    shards: Sequence[dict[str, Any]],
    *,
    stream_shards: Sequence[dict[str, Any]] | None,
    steps: int,
    where: str,
) -> list[str]:
    """Load this stage's part of `shards` (the old stages holding its layers, in order).

    stream_shards: the shards of this rank's own replica (None: the checkpoint had no such
    replica). Returns what could not move, as sentences for a warning."""
    sk = stage_keys(module)
    saved: dict[str, torch.Tensor] = {}
    for shard in shards:
        for k, v in shard["model"].items():
            saved.setdefault(k, v)
    _check_model(module, sk, saved, where)
    values = {local: saved[key] for local, key in sk.keys.items()}
    for local, p in module.named_parameters():  # a frozen one rounded by loading: kept
        keep_exact(p, values[local], p.dtype)
    module.load_state_dict(values)
    if updater is not None:
        _restore_optimizer(module, sk, updater, shards, saved, where)
    unmoved = []
    if streams is not None:
        found: dict[str, Any] = {}
        for shard in stream_shards or ():
            found.update(shard.get("streams", {}))
        fresh = streams.load_state_dict(found, steps)
        if fresh:
            whole = set(found) == {"model"}  # saved by a model that ran its own forward
            unmoved.append(
                _unmoved_streams(fresh, streams.replica, stream_shards is None, where, whole)
            )
    return unmoved


def _unmoved_streams(
    fresh: list[str], replica: int, no_replica: bool, where: str, whole: bool = False
) -> str:
    what = "its layers'" if fresh != ["model"] else "its model's"
    if no_replica:
        why = f"the checkpoint has no replica {replica}"
    elif whole and fresh != ["model"]:
        why = (
            "the checkpoint holds the one random stream of a model that ran its own forward "
            "(as one-stage runs did before they drew from their layers' streams)"
        )
    elif fresh == ["model"]:
        why = (
            "the checkpoint holds one stream per layer, and this one-stage model runs its "
            "own forward"
        )
    else:
        why = f"the checkpoint holds no stream for layer(s) {', '.join(fresh)}"
    return (
        f"{where}: {why}, so {what} random streams start anew (seeded from the seed, the "
        f"layer, replica {replica} and the step); dropout continues, but not as the saved run "
        f"would have"
    )


def _check_model(
    module: nn.Module, sk: StageKeys, saved: dict[str, torch.Tensor], where: str
) -> None:
    """Raise naming every entry that is missing, unexpected or of another shape."""
    mine = {sk.keys[k]: v for k, v in module.state_dict().items()}
    ours = None
    if sk.layers is not None:
        lo, hi = sk.layers
        ours = {k for k in saved if _layer_of(k) is not None and lo <= _layer_of(k) < hi}
    problems = mismatches(mine, saved, ours)
    if problems:
        raise ReshardError(f"{where} does not match this model:{listed(problems)}")


def mismatches(
    mine: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], ours: set[str] | None = None
) -> list[str]:
    """Every entry missing from `saved`, unexpected in it (of `ours`: the saved keys this
    model should hold, default all), or of another shape."""
    problems = [
        f"missing from the checkpoint: {key} {tuple(mine[key].shape)}"
        for key in sorted(set(mine) - set(saved))
    ]
    for key in sorted((set(saved) if ours is None else ours) - set(mine)):
        problems.append(f"not in this model: {key} {tuple(saved[key].shape)}")
    for key in sorted(set(mine) & set(saved)):
        if tuple(mine[key].shape) != tuple(saved[key].shape):
            problems.append(
                f"{key}: checkpoint has shape {tuple(saved[key].shape)}, "
                f"model has {tuple(mine[key].shape)}"
            )
    return problems


def listed(problems: list[str], most: int = 20) -> str:
    """The problems as indented lines for an error message, the first `most` of them."""
    more = f"\n  ... and {len(problems) - most} more" if len(problems) > most else ""
    return "\n  " + "\n  ".join(problems[:most]) + more


def _layer_of(key: str) -> int | None:
    head = key.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _restore_optimizer(module, sk, updater, shards, saved, where) -> None:
    """The optimizer's state_dict rebuilt for this stage's own groups, from the saved state
    of each parameter (found by its layer keys), then loaded as the Updater loads any."""
    entries: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    loss_scale = None
    mine = _kind(updater.optimizer)
    for shard in shards:
        opt = shard.get("optimizer")
        if opt is None:
            continue
        if opt.get("kind", mine) != mine:  # checkpoints before the kind was kept: not checked
            raise ReshardError(
                f"{where}: the checkpoint's optimizer is {opt['kind']}, this trainer's is "
                f"{mine}; its state (and settings) would not mean the same here: resume with "
                "the optimizer it was saved with"
            )
        loss_scale = loss_scale or opt.get("loss_scale")
        for entry in opt["params"]:
            group = opt["groups"][entry["group"]]
            for key in entry["keys"]:
                entries.setdefault(key, (entry, group))
    keys_of = _param_keys(module, sk)
    param_of = {id(m): p for p, m in zip(updater.params, updater.masters, strict=True)}
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for g, group in enumerate(updater.optimizer.param_groups):
        settings = None
        indices = []
        for master in group["params"]:
            p = param_of.get(id(master), master)
            found = next((entries[k] for k in keys_of.get(id(p), []) if k in entries), None)
            if found is not None:
                entry, saved_group = found
                if entry["state"]:
                    state[index] = entry["state"]
                if settings is None:
                    settings = saved_group
                elif _settings(saved_group) != _settings(settings):
                    raise ReshardError(
                        f"{where}: parameter group {g} of this stage holds parameters that were "
                        f"in groups with different settings ({_settings(settings)} and "
                        f"{_settings(saved_group)}); group them as the saved run did"
                    )
            indices.append(index)
            index += 1
        mine = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        groups.append({**mine, **(_settings(settings) if settings else {}), "params": indices})
        if "param_names" in group:
            groups[-1]["param_names"] = group["param_names"]
    masters = None
    if updater.masters is not updater.params:
        masters = []
        for p in updater.params:
            key = keys_of[id(p)][0]
            masters.append(saved[key].to(torch.float32))
    updater.load_state_dict(
        {
            "optimizer": {"state": state, "param_groups": groups},
            "masters": masters,
            "loss_scale": loss_scale,
        }
    )


def _kind(optimizer: Any) -> str:
    """An optimizer's class as a checkpoint names it: `torch.optim.adamw.AdamW`."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


_SCHEDULER_KIND = "_myelin_kind"  # the saved scheduler's class, beside its state


def load_scheduler(scheduler: Any, state: dict[str, Any], where: str) -> None:
    """`scheduler.load_state_dict` of a `scheduler_state`; a scheduler of another class
    than the saved one is a CheckpointError naming both (torch would mix their states:
    a OneCycleLR's into a StepLR, silently)."""
    state = dict(state)
    kind = state.pop(_SCHEDULER_KIND, None)
    if kind is not None and kind != _kind(scheduler):
        raise CheckpointError(
            f"{where}: the checkpoint's LR scheduler is a {kind}, this run's a "
            f"{_kind(scheduler)}; build the same scheduler to resume it, or build the new one "
            f"after a step (it then starts afresh)"
        )
    scheduler.load_state_dict(state)


def scheduler_state(shard: dict[str, Any], updater: Any, module: nn.Module) -> Any:
    """The saved LR scheduler's state (None if none was saved), its per-group lists
    following their groups: new group g takes the entry of the saved group its first
    parameter was in."""
    if shard.get("lr_scheduler") is None:
        return None
    state = dict(shard["lr_scheduler"])
    state[_SCHEDULER_KIND] = shard.get("lr_scheduler_kind")  # (load_scheduler checks it)
    opt = shard.get("optimizer")
    if updater is None or opt is None:
        return state
    sk = stage_keys(module)
    old_groups = len(opt["groups"])
    group_of = {k: e["group"] for e in opt["params"] for k in e["keys"]}
    keys_of = _param_keys(module, sk)
    param_of = {id(m): p for p, m in zip(updater.params, updater.masters, strict=True)}
    mapping = []
    for g, group in enumerate(updater.optimizer.param_groups):
        old = next(
            (
                group_of[k]
                for m in group["params"]
                for k in keys_of.get(id(param_of.get(id(m), m)), [])
                if k in group_of
            ),
            min(g, old_groups - 1),
        )
        mapping.append(old)
    for name, value in state.items():
        if isinstance(value, list) and len(value) == old_groups:
            state[name] = [value[i] for i in mapping]
    return state
