"""The model as the Hogbatch workers receive it: spawning pickles it, which torch refuses for
a module under a parametrization (weight_norm, orthogonal), so those travel plain and get
their parametrizations back in the worker.

`portable` (in the runner) takes each module's parametrizations off a copy, keeping them
beside it with the model's state_dict; `rebuild` (in a worker) registers them again, in
the same order, and loads that state, so the worker's trainable parameters are the
runner's, name for name. The copy carries no state_dict hooks (weight_norm's is a local
function, which cannot be pickled): a worker never saves or loads a state_dict of its own.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn.utils import parametrize

from myelin.errors import ConfigError

__all__ = ["portable", "rebuild"]

_STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")  # fmt: skip


def portable(model: torch.nn.Module) -> dict[str, Any]:
    """What the spawn sends for `model`: a copy without parametrizations, the parametrizations
    (module, tensor, their modules in order), the state to load and which parameters train.
    One that the workers could not rebuild as it is here is a ConfigError naming it."""
    plain = copy.deepcopy(model)
    parts = []
    for path, m in [(p, m) for p, m in plain.named_modules() if parametrize.is_parametrized(m)]:
        lists = m.parametrizations
        with torch.no_grad():
            values = {name: getattr(m, name).detach() for name in lists}
        # the instance's class only: a deep copy shares the parametrized class with `model`
        m.__class__ = parametrize.type_before_parametrizations(m)
        del m.parametrizations
        for name, chain in lists.items():
            m.register_parameter(name, torch.nn.Parameter(values[name], requires_grad=False))
            parts.append((path, name, list(chain), bool(chain.unsafe)))
    for m in plain.modules():
        for hooks in _STATE_HOOKS:
            getattr(m, hooks).clear()
    sent = {"model": plain, "parametrizations": parts, "state": None,
            "trains": {n: p.requires_grad for n, p in model.named_parameters()}}  # fmt: skip
    if parts:
        sent["state"] = model.state_dict()
        _check_rebuilds(model, sent)
    return sent


def rebuild(sent: dict[str, Any]) -> torch.nn.Module:
    """The worker's own model from `portable`'s output (a private copy: the spawn hands every
    process the same shared-memory storage for the tensors it sent)."""
    sent = copy.deepcopy(sent)
    model = sent["model"]
    for path, name, chain, unsafe in sent["parametrizations"]:
        m = model.get_submodule(path)
        for p in chain:
            parametrize.register_parametrization(m, name, p, unsafe=unsafe)
    if sent["state"] is not None:
        model.load_state_dict(sent["state"])
    for name, p in model.named_parameters():
        p.requires_grad_(sent["trains"][name])
    return model


def _check_rebuilds(model: torch.nn.Module, sent: dict[str, Any]) -> None:
    """Rebuild here, before any worker starts: the parameters must come out the same."""
    where = sorted({path or "(the model)" for path, *_ in sent["parametrizations"]})
    try:
        again = rebuild(sent)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(
            f"Hogbatch: the parametrizations of modules {where} cannot be registered again "
            f"in the worker processes ({type(e).__name__}: {e})"
        ) from e
    want = [(n, p.shape) for n, p in model.named_parameters()]
    got = [(n, p.shape) for n, p in again.named_parameters()]
    if got != want:
        raise ConfigError(
            f"Hogbatch: the workers' copy of the model, the parametrizations of modules "
            f"{where} registered again, has other parameters ({got}) than the model ({want})"
        )
