"""The per-device event loop: messages make operations ready; the policy picks what runs.

One step of training on one rank:
1. poll the inbox (with a timeout, so a stuck peer is noticed);
2. activation for microbatch i -> Forward(i) ready; gradient for i -> Backward(i)
   ready; stage 0 has every Forward ready from local data, under a window of
   `max_inflight` microbatches;
3. run the ready operation the policy picks (backward first, oldest first);
4. hand outputs to the transport without waiting for the send;
5. when every backward of the step has run here, let the replicas agree (average
   gradients across data-parallel replicas), then sum the gradients of parameters other
   stages hold too (tied.py), step the optimizer, and return the loss.

Evaluation is the same drive loop under the forward-only policy. `inbox.py` sorts arrived
messages, `outbox.py` sends outputs, replicas agree through a `myelin/replicas/` strategy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from myelin.errors import ConfigError, DeadlineError, MyelinError
from myelin.offload.budget import DeviceBudget
from myelin.offload.optimizer import Updater
from myelin.profile.timeline import Timeline
from myelin.replicas import Strategy
from myelin.replicas.allreduce import AllReduceReplicas
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import World, sum_gradients
from myelin.runtime.inbox import Inbox, LoopStats
from myelin.runtime.messages import Message
from myelin.runtime.outbox import Outbox
from myelin.runtime.schedule import Action, ForwardOnly, Policy, Ready
from myelin.runtime.stage import InputMismatch, Stage, as_tuple
from myelin.runtime.step_losses import as_floats, mean_loss
from myelin.runtime.tied import MicrobatchTies, Tied
from myelin.runtime.waits import describe_wait, misfit

__all__ = ["LoopConfig", "LoopStats", "EventLoop"]

log = logging.getLogger(__name__)
_KIND = {"B": "backward", "I": "input gradients", "W": "weight gradients"}
_WAITS = {"offload": ("offload_wait", "offload"), "allreduce": ("collective_wait", "collective")}


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopConfig:
    """Per-step settings of the loop; validated by the trainer's config."""

    microbatches: int
    timeout_s: float
    poll_s: float = 0.05
    tied_grads: str = "microbatch"  # tied gradients added per microbatch (tied.py); "step"

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ConfigError(f"microbatches={self.microbatches} must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout={self.timeout_s} must be > 0 seconds")


class EventLoop:
    """Runs one rank's share of each training step, driven by arriving messages."""

    def __init__(
        self,
        stage: Stage,
        world: World,
        transport: Any,
        policy: Policy,
        updater: Updater | None,
        config: LoopConfig,
        timeline: Timeline | None = None,
        tied: list[Tied] | None = None,
        budget: DeviceBudget | None = None,
        *,
        flight: FlightRecorder | None = None,
        liveness: Any = None,
        replicas: Strategy | None = None,
        clip: Any = None,
    ) -> None:
        self.stage = stage
        self.world = world
        self.transport = transport
        self.policy = policy
        self.updater = updater
        self.config = config
        self.budget = budget
        self.stats = LoopStats()
        self.flight = flight or FlightRecorder(world.rank)
        self.liveness = liveness  # heartbeats (runtime/liveness.py), when peers exist
        self.tied = tied or []  # parameters shared with other stages of this replica
        per_mb = self.tied and config.tied_grads == "microbatch"
        self.ties = MicrobatchTies(stage.index, self.tied, updater) if per_mb else None
        self.timeline = timeline or Timeline(world.rank, stage.index, enabled=False)
        if replicas is None and world.dp_group is not None:
            replicas = AllReduceReplicas(world.dp_group, world.layout.data_parallel, world.waits)
        self.replicas = replicas  # None: one replica, nothing to agree on
        self.clip = clip  # runtime/clip.py: a stage with nothing to train still joins its norm
        self.inbox = Inbox(stage, world, transport, config.microbatches, self.stats,
                           timeline=self.timeline, flight=self.flight, liveness=liveness,
                           ties=self.ties)  # fmt: skip
        self.outbox = Outbox(stage.index, stage.device, world, transport, self.timeline,
                             self.flight)  # fmt: skip
        self._forward_only = ForwardOnly()
        if policy.splits:  # tied parameters' gradients stay in I: tied.py's hooks sum them
            stage.split_backward(keep=[p for tie in self.tied for p in tie.params])

    # -- one step ------------------------------------------------------------

    def run_step(
        self,
        step: int,
        inputs: Sequence[tuple[torch.Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        rows: Sequence[int] | None = None,
        where: str | None = None,
    ) -> float:
        """Run forward and backward of every microbatch of `step` on this stage, then update.
        `where` names the step in errors and in what this rank says it is doing (the
        trainer's "training step 3"; `step` counts evaluations too, from 0).

        Returns the loss of the step: the mean of the microbatch losses (weighted by `rows`,
        their row counts, when the batch split unevenly; the last stage tells the others),
        averaged over data-parallel replicas, the same on every rank.
        """
        stage = self.stage
        if self.updater is not None:
            self.updater.changed = False  # (first: a step failed before it changed nothing)
        ready, local = self._begin(step, inputs, targets, rows, where)
        self._losses: dict[int, float | torch.Tensor] = {}  # a tensor: this stage's own
        if stage.activations is not None:
            stage.activations.begin_step()
        if self.updater is not None and self.updater.scaler is not None:
            stage.loss_scale = self.updater.scaler.scale
        self.policy.begin_step(ready)
        self.inbox.begin(step, ready, local)  # takes what came early for this step
        try:
            self._drive(ready, self.policy)
            self._drain_sends()
        except BaseException:
            stage.clear()
            if self.ties is not None:
                self.ties.clear()
            raise
        loss = self._mean(self._losses, self.inbox.rows)
        self.flight.now(f"reducing gradients at the end of {self._where}")
        loss = self._agree(loss, train=True)  # replicas reduce first: every tie holder sums alike
        for tie in self.tied:  # each holder applies the same update: the copies stay equal
            start = self.timeline.now()
            sum_gradients(self.updater.grads.holders_of(tie.params), tie.group, self.world.waits)
            self._waited("allreduce", f"{self.stage.index}TIED", start)
        if self.updater is not None:
            self.flight.now(f"in the optimizer step of {self._where}")
            self._update(step)
            if self.replicas is not None:
                start = self.timeline.now()
                self.replicas.after_optimizer_step()
                self._waited("allreduce", f"{self.stage.index}SYNC", start)
        elif self.clip is not None:
            self.clip.clip([])
        self.flight.now(f"between steps ({self._where} done)")
        if self.budget is not None:
            self.budget.set("gradients", 0, "")
        if self.replicas is not None:
            self.replicas.step_end()
        return loss

    def run_eval(
        self,
        step: int,
        inputs: Sequence[tuple[torch.Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        rows: Sequence[int] | None = None,
        where: str | None = None,
    ) -> float:
        """Forward every microbatch without gradients; the mean loss, on every rank.

        `step` shares the numbering of training steps (the trainer counts both), so
        messages of an evaluation never mix with those of a training step.
        """
        stage = self.stage
        ready, local = self._begin(step, inputs, targets, rows, where or f"evaluation {step}")
        self._eval_losses: dict[int, float] = {}
        self.inbox.begin(step, ready, local, evaluating=True)  # takes what came early
        try:
            self._drive(ready, self._forward_only)
            if stage.is_last:
                ready.loss = self._mean(self._eval_losses, self._rows)
                meta = {"op": "eval_loss", "value": ready.loss}
                for s in range(stage.num_stages - 1):
                    msg = Message("control", self.world.rank, step, 0, s, [], meta)
                    self.transport.send(self.world.peer(s), msg)
            self._drain_sends()
        except BaseException:
            self.inbox.early.clear()
            raise
        return self._agree(ready.loss, train=False)

    def _begin(
        self,
        step: int,
        inputs: Sequence[tuple[torch.Tensor, ...]] | None,
        targets: Sequence[Any] | None,
        rows: Sequence[int] | None,
        where: str | None,
    ) -> tuple[Ready, dict[int, tuple[torch.Tensor, ...]]]:
        """Per-step state shared by training and evaluation; stage 0's forwards are ready
        with its local inputs."""
        self._rows = dict(enumerate(rows)) if rows is not None and self.stage.is_last else {}
        stage = self.stage
        if stage.is_first and inputs is None:
            raise ConfigError(f"rank {self.world.rank} holds stage 0 and needs the inputs")
        if stage.is_last and targets is None:
            raise ConfigError(f"rank {self.world.rank} holds the last stage and needs the targets")
        ready = Ready(stage.index, stage.num_stages, self.config.microbatches)
        self._step = step
        self._where = where or f"step {step}"
        self._targets = stage.step_targets(targets) if stage.is_last else targets
        local: dict[int, tuple[torch.Tensor, ...]] = {}
        if stage.is_first:
            local = {i: as_tuple(inputs[i]) for i in range(ready.microbatches)}
            ready.forward = set(range(ready.microbatches))
        return ready, local

    def _drive(self, ready: Ready, policy: Policy) -> None:
        """Run what `policy` picks, waiting for messages when nothing is ready, until the
        policy says this stage's share of the step is done."""
        last_progress, idle = time.monotonic(), False
        while not policy.done(ready):
            self.outbox.flush()
            action = policy.pick(ready)
            if action is not None:
                idle = False
                self._run(action, ready, policy)
                if self.transport is not None:
                    self.inbox.handle(self.inbox.poll_now(), ready)
                last_progress = time.monotonic()
                continue
            if self.transport is None:
                raise MyelinError(f"one-rank loop has nothing to run: {ready}")
            if not idle:  # once per stretch of waiting, not once per poll
                idle = True
                self._prefetch()
                waiting = policy.waiting_for(ready) or "the step's loss"
                self.flight.now(f"waiting to run {waiting} in {self._where}")
            wait = self.config.poll_s if not self.outbox.copying else 0.0005
            if self.inbox.handle(self.inbox.wait(wait), ready):
                idle = False
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > self.config.timeout_s:
                waited = time.monotonic() - last_progress
                why = describe_wait(self.world, self._where, ready, waited, policy)
                raise DeadlineError(why + self.inbox.pieces_missing(ready))

    def _share(self, mb: int) -> float | None:
        """Microbatch `mb`'s share of the batch's rows when it split unevenly (else None)."""
        if not self._rows:
            return None
        return self._rows[mb] / sum(self._rows.values())

    def _floats(self, losses: dict[int, Any]) -> dict[int, float]:
        where = f"rank {self.world.rank} (stage {self.stage.index}): {self._where}"
        return as_floats(losses, self.config.microbatches, where)

    def _mean(self, losses: dict[int, Any], rows: dict[int, int]) -> float:
        step_loss = self.stage.step_loss if self.stage.shares else None
        return mean_loss(self._floats(losses), rows, self.config.microbatches, step_loss)

    # -- operations ----------------------------------------------------------

    def _run(self, action: Action, ready: Ready, policy: Policy) -> None:
        mb = action.microbatch
        kind = _KIND.get(action.kind, "forward" if policy.trains else "eval")
        self.flight.now(f"running {action} ({kind} of microbatch {mb}) in {self._where}")
        self.flight.note("run %s", action)
        if kind == "forward":
            self._forward(action, ready)
        elif kind == "weight gradients":  # the W of a split backward: nothing to send
            with self.timeline.op("backward", str(action), self._step, microbatch=mb):
                self.stage.backward_weight(mb)
            ready.ran("W", mb)
            self.stats.weights += 1
        elif kind == "eval":
            self._evaluate(action, ready)
        else:
            self._backward(action, ready)

    def _forward(self, action: Action, ready: Ready) -> None:
        mb, stage = action.microbatch, self.stage
        ready.forward.discard(mb)
        inputs = self.inbox.inputs.pop(mb)
        target = self._targets[mb] if stage.is_last else None
        backward_next = self.policy.backward_next(ready, mb)
        share = self._share(mb)
        with self.timeline.op("forward", str(action), self._step, microbatch=mb):
            try:  # the compute only: the send below is not the device's time
                outputs = stage.forward(
                    mb, inputs, target, ready.microbatches, backward_next, share
                )
            except InputMismatch as exc:
                raise misfit(
                    self.world, stage.index, self._where, mb, inputs, exc.__cause__
                ) from exc.__cause__
        ready.ran("F", mb)
        self.stats.forwards += 1
        if stage.is_last:
            self._losses[mb] = stage.loss(mb)
            self.inbox.grads[mb] = ([], [], None)
            if mb in self._rows:
                self.inbox.rows[mb] = self._rows[mb]
            ready.backward.add(mb)
        else:
            detached = [o.detach() for o in outputs]
            self.outbox.send(self._step, stage.index + 1, "activation", mb, detached, {})

    def _backward(self, action: Action, ready: Ready) -> None:
        mb, stage = action.microbatch, self.stage
        ready.backward.discard(mb)
        grads, index, losses = self.inbox.grads.pop(mb)
        if losses is not None:  # the next stage's last gradient of the step: every loss
            self._losses = dict(enumerate(losses))
        self._before_backward(mb, ready, whole=action.kind == "B")
        if self.ties is not None:
            self.ties.before_backward(self.inbox.pieces.pop(mb, {}))
        with self.timeline.op("backward", str(action), self._step, microbatch=mb):
            in_grads, in_index = stage.backward(mb, grads, index, split=action.kind == "I")
        if self.ties is not None:  # this stage's pieces of tied gradients, to their first holder
            for dest, keys, pieces in self.ties.after_backward():
                self.outbox.send(self._step, dest, "tied", mb, pieces, {"keys": keys})
        self._record_waits()
        self._prefetch()
        ready.ran("B", mb)
        if stage.weights_wait(mb):  # its W runs when the policy picks it
            ready.weights.append(mb)
        self.stats.backwards += 1
        if not stage.is_first:
            meta: dict[str, Any] = {"index": in_index}
            if ready.backwards_done == ready.microbatches:  # the step's last: its losses
                self._losses = self._floats(self._losses)
                meta["losses"] = [self._losses[i] for i in range(ready.microbatches)]
            if mb in self.inbox.rows:
                meta["rows"] = self.inbox.rows[mb]
            self.outbox.send(self._step, stage.index - 1, "gradient", mb, in_grads, meta)

    def _evaluate(self, action: Action, ready: Ready) -> None:
        mb, stage = action.microbatch, self.stage
        ready.forward.discard(mb)
        with self.timeline.op("eval", str(action), self._step, microbatch=mb):
            out = stage.evaluate(
                self.inbox.inputs.pop(mb), self._targets[mb] if stage.is_last else None
            )
        ready.ran("F", mb)
        if stage.is_last:
            self._eval_losses[mb] = out
        else:
            meta = {"eval": True}  # a peer training this step refuses it (inbox)
            self.outbox.send(self._step, stage.index + 1, "activation", mb, list(out), meta)

    def _update(self, step: int) -> None:
        """The optimizer step; on a GPU with the update on the host, the device idles."""
        if self.updater.mode == "host" and self.stage.device.type == "cuda":
            start = self.timeline.now()
            self.updater.step()
            end = self.timeline.now()
            name = f"{self.stage.index}OPT_HOST"
            self.timeline.add(
                "offload", name, start, end, step, cause="optimizer_host", track="offload"
            )
            return
        with self.timeline.op("optimizer", f"{self.stage.index}OPT", step):
            self.updater.step()

    # -- memory --------------------------------------------------------------

    def _before_backward(self, mb: int, ready: Ready, whole: bool) -> None:
        """Gradients take memory from the step's first backward; the last one, if `whole`
        (not an I whose W comes later), may stream them to the host or start their
        all-reduce (not tied ones: summed after it)."""
        grads = self.updater.grads if self.budget is not None and self.updater is not None else None
        if grads is not None and (ready.backwards_done == 0 or grads.sparse):  # sparse: rows
            self.budget.set("gradients", grads.held_bytes(), f"the backward of microbatch {mb}")
        last = ready.backwards_done == ready.microbatches - 1 and self.updater is not None
        last = last and whole and not ready.weights
        reduced = self.tied or (self.replicas is not None and self.replicas.reduces_gradients)
        if last and not reduced:
            self.updater.arm()
        elif last and not self.tied and self.replicas is not None:
            self.replicas.last_backward(self.updater.grads.params, self.updater.grads.holders)
        store = self.stage.activations
        if store is not None and store.pages_out:
            store.fetch(mb)

    def _record_waits(self) -> None:
        """Backward's waits for pages (at its start and between layers), as offload waits."""
        store = self.stage.activations
        if store is None:
            return
        origin = self.timeline.origin
        for mb, start, end in store.take_waits():
            name = f"{self.stage.index}FETCH{mb}"
            self._waited("offload", name, start - origin, end - origin, microbatch=mb)

    def _prefetch(self) -> None:
        """Bring back the pages of the backwards that come next. On a GPU the copies run on a
        side stream; on a CPU they are copies this rank makes now, recorded as such."""
        store = self.stage.activations
        if store is None or not store.pages_out:
            return
        start = self.timeline.now()
        if store.prefetch_ahead() and self.stage.device.type != "cuda":
            self._waited("offload", f"{self.stage.index}PREFETCH", start)

    def _waited(
        self, kind: str, name: str, start: float, end: float | None = None, **fields: Any
    ) -> None:
        """A span of offload copies or of a collective, from `start` to `end` (default now)."""
        cause, track = _WAITS[kind]
        end = self.timeline.now() if end is None else end
        self.timeline.add(kind, name, start, end, self._step, cause=cause, track=track, **fields)

    # -- the end of a step ---------------------------------------------------

    def _drain_sends(self) -> None:
        """Wait until this step's messages have left, so none is stranded at the step's end."""
        if self.transport is not None:
            self.outbox.drain(self._where, self.config.timeout_s, self.inbox)

    def _agree(self, loss: float, train: bool) -> float:
        """The replicas agree on the loss, and after training on the gradients."""
        if self.replicas is None:
            return loss
        start = self.timeline.now()
        if train:
            holders = self.updater.grads.holders if self.updater is not None else []  # fp32
            loss = self.replicas.backwards_done(holders, loss)
        else:
            loss = self.replicas.eval_loss(loss)
        self._waited("allreduce", f"{self.stage.index}ALLREDUCE", start)
        return loss
