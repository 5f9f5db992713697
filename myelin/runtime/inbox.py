"""What the loop does with the messages that reach it.

The inbox polls the transport: at once after each operation (a `recv` span when a
message came), or waiting when nothing is ready (a `wait` span, idle time with its
cause, named `1RECV_B2` after the message that ended it). A message for the current
step is taken: an activation makes a forward ready, a gradient (with its microbatch's
loss) a backward (with `tied_grads="microbatch"`, once the later holders' pieces of tied
gradients came too), the last stage's evaluation loss ends an evaluation. A message for
the next step (a neighbour ran ahead) is kept for it, but only if addressed to this
stage, and only so many. Anything else (stale, duplicate, misaddressed, out of range,
from a rank that is not the neighbour) is dropped, counted in `LoopStats.rejected` and
logged, never acted on; an `abort` from another rank is raised here as its error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from myelin.errors import MyelinError, PeerLostError, RemoteError
from myelin.profile.timeline import Timeline
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import World
from myelin.runtime.liveness import STOP_GRACE_S
from myelin.runtime.logs import Throttled
from myelin.runtime.messages import Message
from myelin.runtime.outbox import message_span
from myelin.runtime.schedule import Ready
from myelin.runtime.stage import Stage
from myelin.runtime.tied import MicrobatchTies

__all__ = ["Inbox", "LoopStats"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoopStats:
    """Counters a user or test can read off `trainer.loop.stats`."""

    forwards: int = 0
    backwards: int = 0  # B and I operations
    weights: int = 0  # W operations: the weight gradients a split backward left
    rejected: int = 0
    early: int = 0


class Inbox:
    """Arrived messages, sorted into this step's, the next step's, and dropped ones."""

    def __init__(
        self,
        stage: Stage,
        world: World,
        transport: Any,
        microbatches: int,
        stats: LoopStats,
        *,
        timeline: Timeline,
        flight: FlightRecorder,
        liveness: Any = None,
        ties: MicrobatchTies | None = None,
    ) -> None:
        self.stage = stage
        self.world = world
        self.transport = transport
        self.microbatches = microbatches
        self.stats = stats
        self.timeline = timeline
        self.flight = flight
        self.liveness = liveness  # heartbeats: a rank's own view of a lost peer comes first
        self._warn = Throttled(log)
        self.step = 0
        self.evaluating = False  # the step under way is an evaluation
        self.early: list[Message] = []
        self.inputs: dict[int, tuple[torch.Tensor, ...]] = {}  # by microbatch, for forwards
        # for backwards: output gradients, their positions, and the step's losses on the
        # step's last gradient (None on the others)
        self.grads: dict[int, tuple[list[torch.Tensor], list[int], list[float] | None]] = {}
        self.rows: dict[int, int] = {}  # rows of each microbatch of a batch split unevenly
        self.ties = ties  # tied gradients added per microbatch: their pieces come first
        self.pieces: dict[int, dict[int, tuple[list[int], list[torch.Tensor]]]] = {}
        self._arrived: set[tuple[str, int]] = set()

    def begin(
        self,
        step: int,
        ready: Ready,
        inputs: dict[int, tuple[torch.Tensor, ...]],
        evaluating: bool = False,
    ) -> None:
        """Start `step` (a training step, or an evaluation) with stage 0's local `inputs`,
        and take what came for it early."""
        self.step = step
        self.evaluating = evaluating
        self.inputs = inputs
        self.grads = {}
        self.rows = {}
        self.pieces = {}
        self._arrived = set()
        early, self.early = self.early, []
        self.handle(early, ready)

    def poll_now(self) -> list[Message]:
        """Take what has arrived without waiting; time spent receiving is a `recv` span."""
        start = self.timeline.now()
        messages = self.transport.poll(0)
        first = messages[0] if messages and self.timeline.enabled else None
        if first is not None and first.kind != "control":
            message_span(
                self.timeline, self.stage.index, "recv", first, first.src, start, self.step
            )
        return messages

    def wait(self, timeout_s: float, cause: str = "bubble") -> list[Message]:
        """Poll the inbox with nothing to run; the time is idle, recorded with its cause.
        Every wait first makes sure no peer was lost."""
        if self.liveness is not None:
            self.liveness.check()
        start = self.timeline.now()
        with self.timeline.range(f"{self.stage.index}WAIT"):
            messages = self.transport.poll(timeout_s)
        first = messages[0] if messages else None
        name = f"{self.stage.index}WAIT"
        if first is not None and first.kind != "control":
            name = f"{self.stage.index}RECV_{'F' if first.kind == 'activation' else 'B'}"
            name += str(first.microbatch)
        self.timeline.add(
            "wait",
            name,
            start,
            self.timeline.now(),
            self.step,
            cause=cause,
            peer=first.src if first is not None else None,
            microbatch=first.microbatch if first is not None else None,
        )
        return messages

    def handle(self, messages: list[Message], ready: Ready | None) -> int:
        """Act on arrived messages; returns how many were taken for this step (progress:
        rejected junk does not hold a deadline off)."""
        taken = 0
        for msg in messages:
            if msg.kind != "control":
                self.flight.note(
                    "recv %s of microbatch %d (step %d) from rank %d",
                    msg.kind,
                    msg.microbatch,
                    msg.step,
                    msg.src,
                )
            if msg.kind == "control" and msg.meta.get("op") == "abort":
                self._on_abort(msg)
            elif msg.kind == "control" and msg.meta.get("op") != "eval_loss":
                self.reject(msg, f"unknown control op {msg.meta.get('op')!r}")
            elif msg.step > self.step or ready is None:
                self._keep_early(msg)
            elif msg.step < self.step:
                self.reject(msg, f"stale: for step {msg.step}, now at step {self.step}")
            else:
                taken += self._accept(msg, ready)
        return taken

    def _keep_early(self, msg: Message) -> None:
        """Keep a message for the next step (a neighbour ran ahead): only one step ahead,
        only if it is addressed to this stage, and only so many."""
        if msg.step > self.step + 1:
            return self.reject(msg, f"for step {msg.step}, more than one step after {self.step}")
        why = self._misaddressed(msg)
        if why is not None:
            return self.reject(msg, why)
        if len(self.early) >= 4 * self.microbatches:
            return self.reject(msg, "too many messages for the next step")
        self.early.append(msg)
        self.stats.early += 1
        return None

    def _misaddressed(self, msg: Message) -> str | None:
        """Why `msg` cannot be for this stage (wrong stage, microbatch, or sender), or None."""
        stage, mb = self.stage, msg.microbatch
        if msg.kind == "control":  # eval_loss: only the last stage sends it
            if stage.is_last or msg.src != self.world.peer(stage.num_stages - 1):
                return "evaluation loss from a rank that is not the last stage"
            return None
        if msg.stage != stage.index:
            return f"addressed to stage {msg.stage}, this is stage {stage.index}"
        if not 0 <= mb < self.microbatches:
            return f"microbatch {mb} is out of range of {self.microbatches}"
        if msg.kind == "activation":
            if stage.is_first or msg.src != self.world.peer(stage.index - 1):
                return "activation from a rank that is not the previous stage"
        elif msg.kind == "tied":
            if self._source(msg) is None:
                return "tied gradients from a rank that shares no parameters with this stage"
        elif stage.is_last or msg.src != self.world.peer(stage.index + 1):
            return "gradient from a rank that is not the next stage"
        return None

    def _accept(self, msg: Message, ready: Ready) -> bool:
        """Take a message for this step: it makes an operation ready. False if rejected."""
        mb = msg.microbatch
        why = self._misaddressed(msg)
        if why is not None:
            self.reject(msg, why)
            return False
        if msg.kind == "control":
            value = msg.meta.get("value")
            if not isinstance(value, float):
                self.reject(msg, f"evaluation loss {value!r} is not a float")
                return False
            ready.loss = value
            return True
        what = f"tied from {msg.src}" if msg.kind == "tied" else msg.kind
        if (what, mb) in self._arrived:
            self.reject(msg, f"duplicate {what} for microbatch {mb}")
            return False
        if msg.kind == "activation":
            if bool(msg.meta.get("eval", False)) != self.evaluating:
                raise _mixed_steps(msg, self.evaluating, self.world.rank)
            self._arrived.add(("activation", mb))
            self.inputs[mb] = tuple(msg.tensors)
            ready.forward.add(mb)
            return True
        if not self.stage.in_flight(mb):
            self.reject(msg, f"{msg.kind} for microbatch {mb}, which this stage has not run")
            return False
        if msg.kind == "tied":
            return self._accept_pieces(msg, ready)
        index, losses = msg.meta.get("index"), msg.meta.get("losses")
        if not isinstance(index, list) or any(type(i) is not int for i in index):
            raise MyelinError(
                f"rank {self.world.rank}: gradient of microbatch {mb} from rank {msg.src} has "
                f"meta.index={index!r}, expected a list of output positions"
            )
        m = self.microbatches
        if losses is not None and (
            not isinstance(losses, list)
            or len(losses) != m
            or any(not isinstance(v, float) for v in losses)
        ):
            raise MyelinError(
                f"rank {self.world.rank}: gradient of microbatch {mb} from rank {msg.src} has "
                f"meta.losses={losses!r:.200}, expected the step's {m} microbatch losses "
                f"(floats)"
            )
        rows = msg.meta.get("rows")
        if rows is not None and (type(rows) is not int or rows < 1):
            raise MyelinError(
                f"rank {self.world.rank}: gradient of microbatch {mb} from rank {msg.src} has "
                f"meta.rows={rows!r}, expected the microbatch's row count (an int >= 1)"
            )
        self._arrived.add(("gradient", mb))
        self.grads[mb] = (msg.tensors, index, losses)
        if rows is not None:
            self.rows[mb] = rows
        self._maybe_ready(mb, ready)
        return True

    def _source(self, msg: Message) -> int | None:
        """The stage that sent a `tied` message, if it shares parameters with this one."""
        sources = self.ties.sources if self.ties is not None else ()
        return next((s for s in sources if self.world.peer(s) == msg.src), None)

    def _accept_pieces(self, msg: Message, ready: Ready) -> bool:
        """Take a later holder's pieces of tied gradients for one microbatch."""
        source, keys = self._source(msg), msg.meta.get("keys")
        why = self.ties.check(source, keys, msg.tensors)
        if why is not None:
            raise MyelinError(
                f"rank {self.world.rank}: tied gradients of microbatch {msg.microbatch} from "
                f"rank {msg.src}: {why}"
            )
        self._arrived.add((f"tied from {msg.src}", msg.microbatch))
        self.pieces.setdefault(msg.microbatch, {})[source] = (keys, msg.tensors)
        self._maybe_ready(msg.microbatch, ready)
        return True

    def _maybe_ready(self, mb: int, ready: Ready) -> None:
        """A backward is ready once its gradient came, and every later holder's pieces of
        tied gradients when they are added per microbatch."""
        if mb not in self.grads:
            return
        if self.ties is None or self.ties.sources <= set(self.pieces.get(mb, ())):
            ready.backward.add(mb)

    def pieces_missing(self, ready: Ready) -> str:
        """For a deadline's message: the backwards whose gradient came but whose pieces of
        tied gradients did not (and from which ranks), or ""."""
        if self.ties is None:
            return ""
        waiting = []
        for mb in sorted(set(self.grads) - ready.backward):
            missing = sorted(self.ties.sources - set(self.pieces.get(mb, ())))
            ranks = ", ".join(str(self.world.peer(s)) for s in missing)
            waiting.append(f"microbatch {mb} from rank {ranks}")
        if not waiting:
            return ""
        return f"; gradients came, tied gradients did not, for {'; '.join(waiting)}"

    def _on_abort(self, msg: Message) -> None:
        """Another rank failed: raise its error here, as PeerLostError if a peer was lost."""
        if not 0 <= msg.src < self.world.layout.world_size or msg.src == self.world.rank:
            return self.reject(msg, f"abort from rank {msg.src}, which is not a peer")
        detail = str(msg.meta.get("error", "no detail"))
        lost = msg.meta.get("lost")
        if self.liveness is not None:
            self.liveness.check()  # this rank's own view of the loss comes first
            stopped = msg.meta.get("stopped") is True and type(lost) is not int
            if stopped and not self.liveness.stopped:
                # Its launcher stopped it, and most likely this rank too: its own signal
                # (raised from inside the sleep) is the error to raise, if it comes.
                time.sleep(STOP_GRACE_S)
                self.liveness.check()  # or a loss found meanwhile
        if type(lost) is int:
            doing = str(msg.meta.get("doing", "unknown"))
            raise PeerLostError(lost, doing, f"rank {msg.src} reports: {detail}")
        raise RemoteError(msg.src, detail)

    def reject(self, msg: Message, reason: str) -> None:
        """Drop `msg`: count it, note it in the flight record, and log it (throttled)."""
        self.stats.rejected += 1
        self.flight.note(
            "reject %s from rank %d (step %d, microbatch %d): %s",
            msg.kind,
            msg.src,
            msg.step,
            msg.microbatch,
            reason,
        )
        self._warn.warning(
            "rank %d: dropped %s message from rank %d (step %d, microbatch %d): %s",
            self.world.rank,
            msg.kind,
            msg.src,
            msg.step,
            msg.microbatch,
            reason,
        )


def _mixed_steps(msg: Message, evaluating: bool, rank: int) -> MyelinError:
    """A peer ran the other kind of step under this step's number: the script called
    `step` on one rank where another called `eval_step` or `evaluate` (SPMD broken).
    Said at once, before a training forward runs on evaluation inputs."""
    theirs, mine = ("trains", "evaluates") if evaluating else ("evaluates", "trains")
    return MyelinError(
        f"rank {msg.src} {theirs} step {msg.step} while rank {rank} {mine} it: every rank "
        "must call step(), eval_step() and evaluate() alike, in the same order"
    )
