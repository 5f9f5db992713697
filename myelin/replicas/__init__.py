"""How the data-parallel replicas of one stage agree: one module per strategy.

A strategy is chosen with `Trainer(..., sync=...)`: a settings object (`AllReduce()`,
`DASO(...)`, `EASGD(...)`) that is validated when built and, once the world exists, builds
the `Strategy` that runs on this rank (`spec.build(context)`). The event loop calls the
running strategy at fixed points of each training step: before the step's last backward
(`last_backward`: gradients may start to travel as they become final), when the step's
backwards are done (`backwards_done`, which returns the step's loss: the mean over the
replicas under AllReduce, this replica's own under DASO and EASGD, whose replicas hold
different models between exchanges), after the optimizer step, and at the step's end. A
strategy owns its state (a center, a schedule, pending sends), which checkpoints carry
(`state_dict`), and says what the model *is* (`model_view`: the center for EASGD), which
evaluation, `state_dict()` and checkpoints use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from myelin.runtime.group import World

__all__ = ["Context", "Strategy", "own_state"]


@dataclass(slots=True)
class Context:
    """What a strategy is built from: this rank's place, its stage's trainable parameters."""

    world: World
    params: list[torch.nn.Parameter]  # this stage's trainable parameters (empty: none)
    timeout_s: float = 300.0
    timeline: Any = None  # profile/timeline.Timeline, for the strategy's own records
    transport: Any = None  # runtime/transport_config.TransportConfig: host, limits, timeouts
    optimizer: Any = None  # this stage's optimizer (None: nothing to train), for strategies
    # that check which optimizers they can run (Hogbatch: plain SGD)
    tied: Sequence[Any] = ()  # runtime/tied.Tied: this stage's parameters other stages hold
    # too, which a strategy that moves parameters keeps equal (runtime/tied.equalise)
    moved: Sequence[torch.Tensor] | None = None  # the fp32 masters of `params`, where the
    # optimizer steps copies (half precision, optimizer offload): what a strategy moves
    publish: Callable[[], None] | None = None  # the parameters take the masters' values


class Strategy:
    """The hooks a running replica strategy implements; each default does nothing."""

    name = ""  # the settings' name ("easgd", "daso"), which tags its checkpointed state
    reduces_gradients = False  # gradients change after the backwards (they cannot stream early)
    # True: `backwards_done` returns this replica's own loss, no collective per step (the
    # replicas hold different models); fit's rows average it over the replicas
    local_loss = False

    def last_backward(self, params: Sequence[Any], holders: Sequence[Any]) -> None:
        """The step's last backward on this stage is about to run: a gradient is final once
        its parameter's post-accumulate hook runs (`holders[i].grad` is `params[i]`'s fp32
        gradient). Not called where gradients change after the backwards (tied stages)."""

    def backwards_done(self, params: list[torch.nn.Parameter], loss: float) -> float:
        """Every backward of the step has run on this stage: agree on gradients, and return
        the step's loss: the mean over replicas, or this replica's own where `local_loss`.

        `params` hold this stage's fp32 gradients in `.grad`: the trainable parameters in
        fp32, their fp32 sums' carriers under half precision (offload/gradients.py)."""
        return loss

    def eval_loss(self, loss: float) -> float:
        """The loss of an evaluation step, as the replicas agree on it."""
        return loss

    def check_step(self) -> None:
        """Raise a ConfigError when this strategy does not train through `Trainer.step`
        (Hogbatch: its workers take the batches, through `fit`)."""

    def after_optimizer_step(self) -> None:
        """The optimizer has stepped this stage's parameters."""

    def step_end(self) -> None:
        """The step is over on this rank."""

    @contextlib.contextmanager
    def model_view(self) -> Iterator[None]:
        """While open, the stage's parameters hold what the model *is* under this strategy
        (for evaluation, state_dict and checkpoints); the default: the parameters."""
        yield

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state for a checkpoint (tensors and plain data only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; called after the parameters are loaded, by
        every load, with {} where the checkpoint holds no state of this rank (another
        layout, a checkpoint saved before any strategy state): a strategy whose state
        derives from the parameters (EASGD's center, DASO's synchronised ones) then starts
        afresh from the loaded ones."""

    def stats(self) -> dict[str, int]:
        """Bytes this rank put into the strategy's communication, by kind (inside a node,
        across nodes, to the hub), and counts of its exchanges."""
        return {}

    def traffic(self) -> dict[str, dict[str, float]]:
        """This rank's communication by kind ("gradients", "local", "global", "exchange",
        "loss"): bytes it put in, collectives (or hub requests) and seconds it waited."""
        return {}

    def close(self) -> None:
        """Release what the strategy holds (processes, sockets); safe to call twice."""


def own_state(state: dict[str, Any], name: str, marker: str) -> dict[str, Any] | None:
    """`state` if a strategy called `name` saved it, else None (another strategy's, or
    nothing). State is tagged with its strategy's name ("strategy"); older checkpoints'
    untagged state is recognised by the key `marker` only that strategy saves."""
    tag = state.get("strategy")
    if tag is not None:
        return state if tag == name else None
    return state if marker in state else None
