"""Errors that say who waited for what, so a traceback alone tells what never came.

A deadline names the rank, its stage and replica, the step, how long it waited, the
microbatch and the peer it waited for, and the action that message would have made
ready (`1B3`); a forward that failed on what the previous stage sent names the
microbatch, the sending rank and the tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from myelin.errors import MyelinError
from myelin.runtime.group import World
from myelin.runtime.schedule import Policy, Ready

__all__ = ["describe_wait", "misfit"]


def describe_wait(world: World, step: str, ready: Ready, waited: float, policy: Policy) -> str:
    """What a rank that waited `waited` seconds in `step` ("training step 3") was waiting
    for, and from whom."""
    stage, num_stages = ready.stage, ready.num_stages
    where = (
        f"rank {world.rank} (stage {stage}, replica {world.replica}) "
        f"waited {waited:.1f}s in {step}"
    )
    action = policy.waiting_for(ready)
    if not policy.trains:
        if action is not None:
            return (
                f"{where} (evaluation) for the activation of microbatch "
                f"{action.microbatch} from rank {world.peer(stage - 1)}"
            )
        return f"{where} (evaluation) for the loss from rank {world.peer(num_stages - 1)}"
    if action is None:
        return f"{where} with nothing left to wait for ({ready})"
    if action.kind == "F":
        peer, what = world.peer(action.stage - 1), "activation"
    else:
        peer, what = world.peer(action.stage + 1), "gradient"
    return (
        f"{where} for the {what} of microbatch {action.microbatch} from rank {peer} "
        f"(to run {action}); forwards done {ready.forwards_done}, backwards done "
        f"{ready.backwards_done} of {ready.microbatches}"
    )


def misfit(
    world: World, stage: int, step: str, mb: int, inputs: tuple[torch.Tensor, ...], exc: Any
) -> MyelinError:
    """The error for a forward that failed on what the previous stage sent, naming it."""
    got = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in inputs)
    return MyelinError(
        f"rank {world.rank} (stage {stage}) could not run its forward on the activation of "
        f"microbatch {mb} in {step} from rank {world.peer(stage - 1)} "
        f"(tensors {got}): {type(exc).__name__}: {exc}"
    )
