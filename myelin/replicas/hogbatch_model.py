"""The model as the Hogbatch workers receive it: spawning pickles it, which torch refuses for
a module under a parametrization (weight_norm, orthogonal), so those travel plain and get
their parametrizations back in the worker.

`portable` (in the runner) takes each module's parametrizations off a copy, keeping them
beside it with the model's state_dict; `rebuild` (in a worker) registers them again, in
the same order, and loads that state, so the worker's trainable parameters are the
runner's, name for name. The copy carries no state_dict hooks (weight_norm's is a local
function, which cannot be pickled): a worker never saves or loads a state_dict of its own.
`check_model` refuses a model whose state the workers would keep to themselves (buffers a
training forward updates).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.parametrize import is_parametrized, type_before_parametrizations
from torch.nn.utils.spectral_norm import SpectralNorm

from myelin.errors import ConfigError

__all__ = ["check_model", "portable", "rebuild"]

log = logging.getLogger(__name__)

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


def check_model(model: torch.nn.Module, x: torch.Tensor | None = None) -> None:
    """Only parameters are shared: buffers a training forward updates (BatchNorm's running
    statistics, spectral_norm's power iteration, a running normaliser of the user's) would
    stay in each worker's copy and never reach the model, so such a module is a
    ConfigError; with inputs `x`, a training forward of a copy on two of them finds the
    buffers it updates in place. A float64 model trains in the shared fp32 copy, with a
    warning (as the Trainer casts one to its precision)."""
    if any(p.dtype == torch.float64 for p in model.parameters()):
        log.warning("Hogbatch: the model's float64 parameters train as fp32 (the one shared copy)")
    for name, m in model.named_modules():
        where = f"module {name or '(the model)'!r} ({type_before_parametrizations(m).__name__})"
        if (
            getattr(m, "track_running_stats", False)
            and getattr(m, "running_mean", None) is not None
        ):
            raise ConfigError(
                f"Hogbatch shares the parameters only, and {where} keeps running statistics, "
                f"which each worker would update in its own copy and the model would never "
                f"get; use track_running_stats=False or a LayerNorm/GroupNorm"
            )
        if _spectral_norm(m):
            raise ConfigError(
                f"Hogbatch shares the parameters only, and {where} has spectral_norm, whose "
                f"power iteration (its u and v buffers) each worker would update in its own "
                f"copy and the model would never get (it would be evaluated and saved with "
                f"the first ones); use weight_norm, or train it without Hogbatch"
            )
    if x is not None:
        _check_buffers(model, x)


def _check_buffers(model: torch.nn.Module, x: torch.Tensor) -> None:
    """A ConfigError naming a buffer a training forward of a copy of `model` updates."""
    if next(model.buffers(), None) is None:  # nothing to update: no copy to make
        return
    probe = copy.deepcopy(model).train()
    before = {name: b._version for name, b in probe.named_buffers()}
    param = next(probe.parameters(), None)
    sample = x[:2]
    if param is not None:
        dtype = param.dtype if sample.is_floating_point() else sample.dtype
        sample = sample.to(param.device, dtype)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            probe(sample)
    except Exception as exc:  # the run's own forward will say what is wrong, if anything
        log.debug("Hogbatch: the buffer probe's forward failed (%s); not checked", exc)
        return
    for name, b in probe.named_buffers():
        if b._version != before[name]:
            owner, _, leaf = name.rpartition(".")
            kind = type(probe.get_submodule(owner)).__name__
            raise ConfigError(
                f"Hogbatch shares the parameters only, and module {owner or '(the model)'!r} "
                f"({kind}) updates its buffer {leaf!r} in a training forward: each worker "
                f"would update it in its own copy and the model would never get it; make it "
                f"a parameter, update it outside the forward, or train without Hogbatch"
            )


def _spectral_norm(m: torch.nn.Module) -> bool:
    """Whether spectral_norm (the parametrization, or the older forward hook) is on `m`."""
    chains = m.parametrizations.values() if is_parametrized(m) else []
    return any(isinstance(p, _SpectralNorm) for chain in chains for p in chain) or any(
        isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values()
    )
