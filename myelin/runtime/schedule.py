"""Operation names and the policies that choose which ready operation runs next.

Actions use torch.distributed.pipelining's notation: `1F3` is stage 1's forward of
microbatch 3, `1B3` its backward, `1SEND_F3` the send of that forward's output; a backward
split in two (split.py) is `1I3`, the input gradients, sent upstream at once, and `1W3`,
the weight gradients, computed later.
The default policy is message-driven: whatever is ready runs, backward before
forward, oldest microbatch first. "zero-bubble" is the same with split backwards, each W
run when nothing else is ready, in time the stage would otherwise wait. GPipe and 1F1B
are fixed orders, kept to compare.
Evaluation is the forward-only policy: every forward as soon as its input is here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from myelin.errors import ConfigError

__all__ = [
    "Action",
    "SCHEDULES",
    "Ready",
    "Policy",
    "ZeroBubble",
    "ForwardOnly",
    "make_policy",
    "fixed_order",
]

SCHEDULES = ("message-driven", "gpipe", "1f1b", "zero-bubble")
_KINDS = ("F", "B", "I", "W", "SEND_F", "SEND_B", "RECV_F", "RECV_B", "OPT", "ALLREDUCE")
_PATTERN = re.compile(r"^(\d+)(" + "|".join(sorted(_KINDS, key=len, reverse=True)) + r")(\d*)$")


class Action(NamedTuple):
    """One operation of one stage; `str(Action(1, "F", 3)) == "1F3"` and back via parse."""

    stage: int
    kind: str
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind}{mb}"

    @staticmethod
    def parse(text: str) -> Action:
        m = _PATTERN.match(text)
        if m is None:
            raise ValueError(f"{text!r} is not an action such as '1F3', '0B2' or '1SEND_F3'")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None)


@dataclass(slots=True)
class Ready:
    """What this stage could run now, and how far the step has come."""

    stage: int
    num_stages: int
    microbatches: int
    forward: set[int] = field(default_factory=set)  # microbatches whose inputs are here
    backward: set[int] = field(default_factory=set)  # microbatches whose output grads are here
    forwards_done: int = 0
    backwards_done: int = 0
    forwarded: set[int] = field(default_factory=set)  # microbatches whose forward ran here
    backwarded: set[int] = field(default_factory=set)
    loss: float | None = None  # evaluation: the step's loss, once the last stage has told it
    weights: list[int] = field(default_factory=list)  # split backwards whose W waits, I order

    def ran(self, kind: str, mb: int) -> None:
        """Count an operation that ran (an I counts as the backward; its W only leaves
        `weights`)."""
        if kind == "F":
            self.forwards_done += 1
            self.forwarded.add(mb)
        elif kind == "W":
            self.weights.remove(mb)
        else:
            self.backwards_done += 1
            self.backwarded.add(mb)

    def next_missing_forward(self) -> int | None:
        """The smallest microbatch whose activation has not come (nor run), if any."""
        for mb in range(self.microbatches):
            if mb not in self.forwarded and mb not in self.forward:
                return mb
        return None

    @property
    def inflight(self) -> int:
        """Microbatches forwarded on this stage whose backward has not run yet."""
        return self.forwards_done - self.backwards_done


class Policy:
    """Chooses the next action from what is ready, or None to wait for a message."""

    name = "message-driven"
    trains = True  # forwards keep what backward needs; False: forward only (evaluation)
    splits = False  # backwards run as I and W (split.py), not as one B

    def __init__(self, max_inflight: int) -> None:
        self.max_inflight = max_inflight

    def begin_step(self, ready: Ready) -> None:
        """Called once per step before any action of that step."""

    def done(self, ready: Ready) -> bool:
        """Whether this stage's share of the step is over: every backward (and W) has run."""
        return ready.backwards_done >= ready.microbatches and not ready.weights

    def pick(self, ready: Ready) -> Action | None:
        if ready.backward:
            return Action(ready.stage, "B", min(ready.backward))
        if ready.forward and (ready.stage != 0 or ready.inflight < self.max_inflight):
            return Action(ready.stage, "F", min(ready.forward))
        return None

    def backward_next(self, ready: Ready, mb: int) -> bool:
        """Whether the backward of `mb` will run right after its forward (just picked), so
        its saved activations are not worth paging out: on the last stage, backward first."""
        return ready.stage == ready.num_stages - 1

    def waiting_for(self, ready: Ready) -> Action | None:
        """The action this policy would run next if its message had arrived: the oldest
        backward whose gradient has not come, else the first forward whose input has not."""
        waiting = ready.forwarded - ready.backwarded - ready.backward
        if waiting:
            return Action(ready.stage, "B", min(waiting))
        mb = ready.next_missing_forward()
        return Action(ready.stage, "F", mb) if mb is not None else None


class ZeroBubble(Policy):
    """Message-driven with split backwards: an I as soon as its gradient is here, then
    forwards (under the same window), then the oldest W when nothing else is ready.

    The first stage sends no input gradient, so its last backward runs whole (B), after
    every W: the step's gradients are then final in one backward, as the hooks that
    stream or reduce them during it expect (loop.py arms them for a B only).
    """

    name = "zero-bubble"
    splits = True

    def pick(self, ready: Ready) -> Action | None:
        if ready.backward:
            if ready.stage == 0 and ready.backwards_done == ready.microbatches - 1:
                if ready.weights:
                    return Action(ready.stage, "W", ready.weights[0])
                return Action(ready.stage, "B", min(ready.backward))
            return Action(ready.stage, "I", min(ready.backward))
        action = super().pick(ready)
        if action is None and ready.weights:
            return Action(ready.stage, "W", ready.weights[0])
        return action


class FixedPolicy(Policy):
    """Runs a precomputed per-stage order, waiting whenever the next action is not ready."""

    def __init__(self, name: str, max_inflight: int) -> None:
        super().__init__(max_inflight)
        self.name = name
        self._order: list[Action] = []
        self._pos = 0

    def begin_step(self, ready: Ready) -> None:
        self._order = fixed_order(self.name, ready.stage, ready.num_stages, ready.microbatches)
        self._pos = 0

    def pick(self, ready: Ready) -> Action | None:
        if self._pos >= len(self._order):
            return None
        action = self._order[self._pos]
        pool = ready.forward if action.kind == "F" else ready.backward
        if action.microbatch not in pool:
            return None
        self._pos += 1
        return action

    def backward_next(self, ready: Ready, mb: int) -> bool:
        return self.waiting_for(ready) == Action(ready.stage, "B", mb)

    def waiting_for(self, ready: Ready) -> Action | None:
        return self._order[self._pos] if self._pos < len(self._order) else None


class ForwardOnly(Policy):
    """Evaluation: every forward as soon as its input is here, oldest first; no backward.

    The step is over on the last stage when every forward has run, elsewhere once the
    last stage has also sent the step's loss (`ready.loss`).
    """

    name = "forward-only"
    trains = False

    def __init__(self) -> None:
        super().__init__(max_inflight=0)  # nothing stays in flight, so nothing to bound

    def pick(self, ready: Ready) -> Action | None:
        return Action(ready.stage, "F", min(ready.forward)) if ready.forward else None

    def done(self, ready: Ready) -> bool:
        last = ready.stage == ready.num_stages - 1
        return ready.forwards_done >= ready.microbatches and (last or ready.loss is not None)

    def backward_next(self, ready: Ready, mb: int) -> bool:
        return False

    def waiting_for(self, ready: Ready) -> Action | None:
        """The first forward whose input has not come; None once only the loss is missing."""
        mb = ready.next_missing_forward()
        return Action(ready.stage, "F", mb) if mb is not None else None


def fixed_order(name: str, stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """The compute actions of one stage for one step under GPipe or 1F1B."""
    m = microbatches
    if name == "gpipe":
        return [Action(stage, "F", i) for i in range(m)] + [Action(stage, "B", i) for i in range(m)]
    if name == "1f1b":
        warmup = min(m, num_stages - stage)
        order = [Action(stage, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(stage, "B", i), Action(stage, "F", warmup + i)]
        order += [Action(stage, "B", i) for i in range(m - warmup, m)]
        return order
    raise ConfigError(f"schedule={name!r} has no fixed order; choose one of {SCHEDULES}")


def make_policy(schedule: str, max_inflight: int) -> Policy:
    """Build the policy named by `schedule` (one of SCHEDULES)."""
    if schedule == "message-driven":
        return Policy(max_inflight)
    if schedule == "zero-bubble":
        return ZeroBubble(max_inflight)
    if schedule in ("gpipe", "1f1b"):
        return FixedPolicy(schedule, max_inflight)
    raise ConfigError(f"schedule={schedule!r} must be one of {SCHEDULES}")
