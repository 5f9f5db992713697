"""Calling the user's optimizer factory with the stage's parameters, by name too.

The factory gets the tensors the optimizer must step (fp32 masters under half precision
or optimizer offload, else the parameters themselves) as a list that also knows their
names in the whole model, so the nanoGPT / transformers idiom of grouping by name works:

    def adamw(params):                       # params: this stage's, a StageParameters
        named = params.named_parameters()    # (name in the whole model, tensor) pairs
        decay = [p for n, p in named if not n.endswith("bias")]
        ...

An optimizer built over other tensors (say `model.named_parameters()` of the user's model,
whose copies the masters are) would train nothing; it is refused, naming the problem.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from myelin.errors import ConfigError

__all__ = ["StageParameters", "build_optimizer"]


class StageParameters(list):
    """The tensors one stage's optimizer steps, in the stage's parameter order; a list, so
    `factory(params)` works with any torch optimizer, with their names besides."""

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        super().__init__(tensors)
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} parameters")
        self.names = list(names)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name in the whole model, tensor) for each parameter, as `Module.named_parameters`
        of the whole model names them."""
        return zip(self.names, list(self), strict=True)


def build_optimizer(
    factory: Callable[..., torch.optim.Optimizer],
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    where: str,
) -> torch.optim.Optimizer:
    """`factory(StageParameters(tensors, names))`, checked to be a torch optimizer over
    those tensors and no others."""
    optimizer = factory(StageParameters(tensors, names))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
        )
    given = {id(t) for t in tensors}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in stepped if id(p) not in given]
    if foreign:
        raise ConfigError(
            f"{where}: the optimizer factory built an optimizer over {len(foreign)} of "
            f"{len(stepped)} tensors that are not the parameters it was given, so those it "
            f"was given would never change (under half precision or optimizer offload it is "
            f"given fp32 master copies, not the model's own parameters). Build it from the "
            f"argument; to group by name use params.named_parameters(), which names them as "
            f"the whole model does, e.g. "
            f"[p for n, p in params.named_parameters() if not n.endswith('bias')]"
        )
    return optimizer

