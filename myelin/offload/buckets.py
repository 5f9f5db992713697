"""How an offloaded optimizer step is cut into buckets of parameters.

A bucket is stepped by giving only its parameters a gradient, which is one whole step
for an optimizer whose state is per parameter (torch's SGD, Adam, AdamW, ...). Another
optimizer may keep state that is no parameter's (a step counter in its param group):
stepped a bucket at a time it would advance once per bucket, so "host" steps it as one
bucket and "stream", which must stage the state a bucket at a time, refuses it.
"""

from __future__ import annotations

import torch

from myelin.errors import ConfigError

__all__ = ["buckets", "steps_per_parameter"]

# torch optimizers whose step() treats each parameter alone (its state is the parameter's).
# LBFGS is not one (one state for all, a closure); subclasses may add state of their own.
_PER_PARAMETER = frozenset(
    getattr(torch.optim, name)
    for name in "ASGD Adadelta Adafactor Adagrad Adam AdamW Adamax Muon NAdam RAdam RMSprop "
    "Rprop SGD SparseAdam".split()
    if hasattr(torch.optim, name)
)


def steps_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` may be stepped a bucket of parameters at a time: one of torch's
    per-parameter optimizers, or a class that says so with `per_parameter_state = True`."""
    kind = type(optimizer)
    return kind in _PER_PARAMETER or getattr(kind, "per_parameter_state", False) is True


def buckets(
    masters: list[torch.Tensor],
    bucket_bytes: int,
    optimizer: torch.optim.Optimizer,
    mode: str,
    where: str,
) -> list[list[int]]:
    """Parameter indices in buckets of about `bucket_bytes` of fp32, last layer first (the
    order backward finishes them). `mode`: "host" or "stream" step bucket by bucket, so an
    optimizer that may not be stepped so is one bucket under "host", refused by "stream";
    any other (one step of all) takes any optimizer."""
    if mode in ("host", "stream") and not steps_per_parameter(optimizer):
        name = type(optimizer).__name__
        if mode == "stream":
            raise ConfigError(
                f"{where}: optimizer offload 'stream' steps the optimizer one bucket of "
                f"parameters at a time, which is one whole step only for an optimizer whose "
                f"state is per parameter; {name} is not one of torch's (SGD, Adam, AdamW, ...). "
                f"If its step() treats each parameter alone, set "
                f"{name}.per_parameter_state = True; else use optimizer offload 'host'"
            )
        return [list(range(len(masters)))]
    cut: list[list[int]] = []
    size = 0
    for i in reversed(range(len(masters))):
        nbytes = masters[i].numel() * 4
        if cut and size + nbytes <= bucket_bytes:
            cut[-1].append(i)
            size += nbytes
        else:
            cut.append([i])
            size = nbytes
    return cut
