"""The per-device event loop: messages make operations ready; the policy picks what runs.

One step of training on one rank:
1. poll the inbox (with a timeout, so a stuck peer is noticed);
2. activation for microbatch i -> Forward(i) ready; gradient for i -> Backward(i)
   ready; stage 0 has every Forward ready from local data, under a window of
   `max_inflight` microbatches;
3. run the ready operation the policy picks (backward first, oldest first);
4. hand outputs to the transport without waiting for the send;
5. when every backward of the step has run here, average gradients across
   data-parallel replicas, step the optimizer, and return the step's loss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from myelin.errors import ConfigError, DeadlineError, MyelinError, PeerLostError, RemoteError
from myelin.offload.budget import DeviceBudget
from myelin.offload.optimizer import Updater
from myelin.offload.pool import HostPool
from myelin.profile.timeline import Timeline
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import World, average_gradients, sum_gradients
from myelin.runtime.logs import Throttled
from myelin.runtime.messages import Message
from myelin.runtime.schedule import Action, Policy, Ready
from myelin.runtime.stage import InputMismatch, Stage, as_tuple

__all__ = ["LoopConfig", "EventLoop"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopConfig:
    """Per-step settings of the loop; validated by the trainer's config."""

    microbatches: int
    timeout_s: float
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ConfigError(f"microbatches={self.microbatches} must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout={self.timeout_s} must be > 0 seconds")


@dataclass(slots=True)
class LoopStats:
    """Counters a user or test can read off `trainer.loop.stats`."""

    forwards: int = 0
    backwards: int = 0
    rejected: int = 0
    early: int = 0


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
        tied: list[tuple[Any, list[torch.nn.Parameter]]] | None = None,
        budget: DeviceBudget | None = None,
    ) -> None:
        self.stage = stage
        self.world = world
        self.transport = transport
        self.policy = policy
        self.updater = updater
        self.config = config
        self.budget = budget
        self._grad_bytes = sum(
            p.numel() * p.element_size() for p in stage.module.parameters() if p.requires_grad
        )
        self.stats = LoopStats()
        self._warn = Throttled(log)
        self.flight = FlightRecorder(world.rank)  # the trainer shares its own
        self.liveness: Any = None  # heartbeats (runtime/liveness.py), when peers exist
        self.tied = tied or []  # (group, parameters) shared with other stages of this replica
        self.timeline = timeline or Timeline(world.rank, stage.index, enabled=False)
        self._step = 0
        self._early: list[Message] = []
        self._outbox: list[tuple[Any, int, Message]] = []  # (copy event, dst, message)
        cuda = stage.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(stage.device) if cuda else None
        # Pinned host buffers that outgoing tensors are copied into on a GPU, from a pool
        # so nothing is pinned in the hot path; freed once the step's sends have left.
        self._staging = HostPool(pin=True, slab_bytes=16 << 20) if cuda else None
        self._staged: list[torch.Tensor] = []

    # -- one step ------------------------------------------------------------

    def run_step(
        self,
        step: int,
        inputs: Sequence[tuple[torch.Tensor, ...]] | None,
        targets: Sequence[Any] | None,
    ) -> float:
        """Run forward and backward of every microbatch of `step` on this stage, then update.

        Returns the loss of the step: the mean of the microbatch losses, averaged over
        data-parallel replicas, the same on every rank.
        """
        m = self.config.microbatches
        stage = self.stage
        ready = self._begin(step, inputs, targets)
        self._grads: dict[int, tuple[list[torch.Tensor], list[int], float]] = {}
        self._losses: dict[int, float] = {}
        if stage.activations is not None:
            stage.activations.begin_step()
        if self.updater is not None and self.updater.scaler is not None:
            stage.loss_scale = self.updater.scaler.scale
        self.policy.begin_step(ready)
        self._handle_early(ready)
        try:
            self._drive(ready)
            self._drain_sends()
        except BaseException:
            stage.clear()
            raise
        loss = sum(self._losses[i] for i in range(m)) / m
        self.flight.now(f"reducing gradients at the end of step {step}")
        self._sum_tied()
        loss = self._average_replicas(loss)
        if self.updater is not None:
            self.flight.now(f"in the optimizer step of step {step}")
            self._update(step)
        self.flight.now(f"between steps (step {step} done)")
        if self.budget is not None:
            self.budget.set("gradients", 0, "")
        return loss

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

    def run_eval(
        self,
        step: int,
        inputs: Sequence[tuple[torch.Tensor, ...]] | None,
        targets: Sequence[Any] | None,
    ) -> float:
        """Forward every microbatch without gradients; the mean loss, on every rank.

        `step` shares the numbering of training steps (the trainer counts both), so
        messages of an evaluation never mix with those of a training step.
        """
        m = self.config.microbatches
        stage = self.stage
        ready = self._begin(step, inputs, targets)
        self._eval_loss = None
        self._handle_early(ready)
        losses = []
        last_progress = time.monotonic()
        try:
            while ready.forwards_done < m or (not stage.is_last and self._eval_loss is None):
                self._flush_outbox()
                if ready.forward:
                    mb = min(ready.forward)
                    ready.forward.discard(mb)
                    with self.timeline.op("eval", f"{stage.index}F{mb}", step, microbatch=mb):
                        out = stage.evaluate(
                            self._inputs.pop(mb), targets[mb] if stage.is_last else None
                        )
                    ready.ran("F", mb)
                    if stage.is_last:
                        losses.append(out)
                    else:
                        self._send(stage.index + 1, "activation", mb, list(out), {})
                    if self.transport is not None:
                        self._handle(self._poll_now(), ready)
                    last_progress = time.monotonic()
                    continue
                if self._handle(self._wait(self.config.poll_s), ready):
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > self.config.timeout_s:
                    raise DeadlineError(
                        self._describe_wait(
                            ready, time.monotonic() - last_progress, evaluating=True
                        )
                    )
            if stage.is_last:
                self._eval_loss = sum(losses) / m
                meta = {"op": "eval_loss", "value": self._eval_loss}
                for s in range(stage.num_stages - 1):
                    msg = Message("control", self.world.rank, step, 0, s, [], meta)
                    self.transport.send(self.world.peer(s), msg)
            self._drain_sends()
        except BaseException:
            self._early.clear()
            raise
        return self._average_replicas(self._eval_loss, grads=False)

    def _begin(
        self,
        step: int,
        inputs: Sequence[tuple[torch.Tensor, ...]] | None,
        targets: Sequence[Any] | None,
    ) -> Ready:
        """Per-step state shared by training and evaluation; stage 0's forwards are ready."""
        stage = self.stage
        if stage.is_first and inputs is None:
            raise ConfigError(f"rank {self.world.rank} holds stage 0 and needs the inputs")
        if stage.is_last and targets is None:
            raise ConfigError(f"rank {self.world.rank} holds the last stage and needs the targets")
        ready = Ready(stage.index, stage.num_stages, self.config.microbatches)
        self._step, self._targets = step, targets
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._arrived: set[tuple[str, int]] = set()
        if stage.is_first:
            self._inputs = {i: as_tuple(inputs[i]) for i in range(ready.microbatches)}
            ready.forward = set(range(ready.microbatches))
        return ready

    def _handle_early(self, ready: Ready) -> None:
        """Take the messages that came for this step while the last one was finishing."""
        early, self._early = self._early, []
        self._handle(early, ready)

    def _drive(self, ready: Ready) -> None:
        last_progress, idle = time.monotonic(), False
        while ready.backwards_done < ready.microbatches:
            self._flush_outbox()
            action = self.policy.pick(ready)
            if action is not None:
                idle = False
                self._run(action, ready)
                if self.transport is not None:
                    self._handle(self._poll_now(), ready)
                last_progress = time.monotonic()
                continue
            if self.transport is None:
                raise MyelinError(f"one-rank loop has nothing to run: {ready}")
            if not idle:  # once per stretch of waiting, not once per poll
                idle = True
                self._prefetch()
                waiting = self.policy.waiting_for(ready)
                self.flight.now(f"waiting to run {waiting} in step {self._step}")
            wait = self.config.poll_s if not self._outbox else 0.0005
            if self._handle(self._wait(wait), ready):
                idle = False
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > self.config.timeout_s:
                raise DeadlineError(self._describe_wait(ready, time.monotonic() - last_progress))

    def _poll_now(self) -> list[Message]:
        """Take what has arrived without waiting; time spent receiving is a `recv` span."""
        start = self.timeline.now()
        messages = self.transport.poll(0)
        first = messages[0] if messages and self.timeline.enabled else None
        if first is not None and first.kind != "control":
            self._comm_span("recv", "RECV", first, first.src, start, self._step)
        return messages

    def _wait(self, timeout_s: float, cause: str = "bubble") -> list[Message]:
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
            self._step,
            cause=cause,
            peer=first.src if first is not None else None,
            microbatch=first.microbatch if first is not None else None,
        )
        return messages

    def _run(self, action: Action, ready: Ready) -> None:
        mb = action.microbatch
        stage = self.stage
        kind = "forward" if action.kind == "F" else "backward"
        self.flight.now(f"running {action} ({kind} of microbatch {mb}) in step {self._step}")
        self.flight.note("run %s", action)
        timed = self.timeline.op(kind, str(action), self._step, microbatch=mb)
        if action.kind == "F":
            ready.forward.discard(mb)
            inputs = self._inputs.pop(mb)
            target = self._targets[mb] if stage.is_last else None
            store = stage.activations
            page_out = store is not None and store.pages_out
            page_out = page_out and not self.policy.backward_next(ready, mb)
            with timed:  # the compute only: the send below is not the device's time
                try:
                    outputs = stage.forward(mb, inputs, target, ready.microbatches, page_out)
                except InputMismatch as exc:
                    raise self._misfit(mb, inputs, exc.__cause__) from exc.__cause__
            ready.ran("F", mb)
            self.stats.forwards += 1
            if stage.is_last:
                self._grads[mb] = ([], [], stage.loss(mb))
                ready.backward.add(mb)
            else:
                self._send(stage.index + 1, "activation", mb, [o.detach() for o in outputs], {})
            return
        ready.backward.discard(mb)
        grads, index, loss = self._grads.pop(mb)
        self._before_backward(mb, ready)
        with timed:
            in_grads, in_index = stage.backward(mb, grads, index)
        self._prefetch()
        self._losses[mb] = loss
        ready.ran("B", mb)
        self.stats.backwards += 1
        if not stage.is_first:
            self._send(stage.index - 1, "gradient", mb, in_grads, {"index": in_index, "loss": loss})

    def _misfit(self, mb: int, inputs: tuple[torch.Tensor, ...], exc: Any) -> MyelinError:
        """The error for a forward that failed on what the previous stage sent, naming it."""
        got = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in inputs)
        src = self.world.peer(self.stage.index - 1)
        return MyelinError(
            f"rank {self.world.rank} (stage {self.stage.index}) could not run its forward on "
            f"the activation of microbatch {mb} in step {self._step} from rank {src} "
            f"(tensors {got}): {type(exc).__name__}: {exc}"
        )

    # -- memory --------------------------------------------------------------

    def _before_backward(self, mb: int, ready: Ready) -> None:
        """Gradients take memory from the step's first backward; the last one may stream
        them to the host; and the microbatch's paged-out activations must be back."""
        if self.budget is not None and ready.backwards_done == 0:
            self.budget.set("gradients", self._grad_bytes, f"the backward of microbatch {mb}")
        last = ready.backwards_done == ready.microbatches - 1
        if last and self.updater is not None and not self.tied and self.world.dp_group is None:
            self.updater.arm()
        store = self.stage.activations
        if store is not None and store.pages_out:
            start = self.timeline.now()
            waited = store.stats.wait_s
            store.fetch(mb)
            if store.stats.wait_s > waited:
                name = f"{self.stage.index}FETCH{mb}"
                end = self.timeline.now()
                self.timeline.add(
                    "offload",
                    name,
                    start,
                    end,
                    self._step,
                    cause="offload_wait",
                    microbatch=mb,
                    track="offload",
                )

    def _prefetch(self) -> None:
        """Bring back the pages of the backwards that come next. On a GPU the copies run on a
        side stream; on a CPU they are copies this rank makes now, recorded as such."""
        store = self.stage.activations
        if store is None or not store.pages_out:
            return
        start = self.timeline.now()
        if store.prefetch_ahead() and self.stage.device.type != "cuda":
            name = f"{self.stage.index}PREFETCH"
            end = self.timeline.now()
            self.timeline.add(
                "offload", name, start, end, self._step, cause="offload_wait", track="offload"
            )

    # -- messages ------------------------------------------------------------

    def _send(
        self, to_stage: int, kind: str, mb: int, tensors: list[torch.Tensor], meta: dict
    ) -> None:
        dst = self.world.peer(to_stage)
        if self._copy_stream is None:
            msg = Message(kind, self.world.rank, self._step, mb, to_stage, tensors, meta)
            self._transmit(dst, msg)
            return
        # On a GPU the device-to-host copy runs on a side stream; the send leaves once
        # the copy's event fires, so the next operation's compute overlaps it.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.stage.device))
        with torch.cuda.stream(self._copy_stream):
            host = []
            for t in tensors:
                buf = self._staging.empty(t.shape, t.dtype, what="an outgoing message")
                self._staged.append(buf)
                buf.copy_(t, non_blocking=True)
                t.record_stream(self._copy_stream)
                host.append(buf)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        msg = Message(kind, self.world.rank, self._step, mb, to_stage, host, meta)
        self._outbox.append((event, dst, msg))

    def _transmit(self, dst: int, msg: Message) -> None:
        start = self.timeline.now()
        self.transport.send(dst, msg)
        self.flight.note("send %s of microbatch %d to rank %d", msg.kind, msg.microbatch, dst)
        if self.timeline.enabled:
            nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
            self._comm_span("send", "SEND", msg, dst, start, msg.step, nbytes=nbytes)

    def _comm_span(
        self, kind: str, op: str, msg: Message, peer: int, start: float, step: int, **more: Any
    ) -> None:
        """Record a send or receive of `msg` on the track of `peer`, named `1SEND_F3` style."""
        name = f"{self.stage.index}{op}_{'F' if msg.kind == 'activation' else 'B'}{msg.microbatch}"
        self.timeline.add(
            kind,
            name,
            start,
            self.timeline.now(),
            step,
            microbatch=msg.microbatch,
            peer=peer,
            track=f"peer {peer}",
            **more,
        )

    def _flush_outbox(self) -> None:
        while self._outbox and self._outbox[0][0].query():
            _, dst, msg = self._outbox.pop(0)
            self._transmit(dst, msg)

    def _drain_sends(self) -> None:
        """Wait until this step's messages have left, so none is stranded at the step's end."""
        if self.transport is None:
            return
        deadline = time.monotonic() + self.config.timeout_s
        for event, _, _ in self._outbox:
            event.synchronize()
        self._flush_outbox()
        while self.transport.pending_sends():
            if time.monotonic() > deadline:
                raise DeadlineError(
                    f"rank {self.world.rank} (stage {self.stage.index}): step {self._step}'s "
                    f"messages were not taken by their peers within {self.config.timeout_s:.0f}s"
                )
            self._handle(self._wait(0.001), None)
        for buf in self._staged:
            self._staging.free(buf)
        self._staged.clear()

    def _handle(self, messages: list[Message], ready: Ready | None) -> int:
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
                self._reject(msg, f"unknown control op {msg.meta.get('op')!r}")
            elif msg.step > self._step or ready is None:
                self._keep_early(msg)
            elif msg.step < self._step:
                self._reject(msg, f"stale: for step {msg.step}, now at step {self._step}")
            else:
                taken += self._accept(msg, ready)
        return taken

    def _keep_early(self, msg: Message) -> None:
        """Keep a message for the next step (a neighbour ran ahead): only one step ahead,
        only if it is addressed to this stage, and only so many."""
        if msg.step > self._step + 1:
            return self._reject(msg, f"for step {msg.step}, more than one step after {self._step}")
        why = self._misaddressed(msg)
        if why is not None:
            return self._reject(msg, why)
        if len(self._early) >= 4 * self.config.microbatches:
            return self._reject(msg, "too many messages for the next step")
        self._early.append(msg)
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
        if not 0 <= mb < self.config.microbatches:
            return f"microbatch {mb} is out of range of {self.config.microbatches}"
        if msg.kind == "activation":
            if stage.is_first or msg.src != self.world.peer(stage.index - 1):
                return "activation from a rank that is not the previous stage"
        elif stage.is_last or msg.src != self.world.peer(stage.index + 1):
            return "gradient from a rank that is not the next stage"
        return None

    def _accept(self, msg: Message, ready: Ready) -> bool:
        """Take a message for this step: it makes an operation ready. False if rejected."""
        mb = msg.microbatch
        why = self._misaddressed(msg)
        if why is not None:
            self._reject(msg, why)
            return False
        if msg.kind == "control":
            value = msg.meta.get("value")
            if not isinstance(value, float):
                self._reject(msg, f"evaluation loss {value!r} is not a float")
                return False
            self._eval_loss = value
            return True
        if (msg.kind, mb) in self._arrived:
            self._reject(msg, f"duplicate {msg.kind} for microbatch {mb}")
            return False
        if msg.kind == "activation":
            self._arrived.add(("activation", mb))
            self._inputs[mb] = tuple(msg.tensors)
            ready.forward.add(mb)
            return True
        if not self.stage.in_flight(mb):
            self._reject(msg, f"gradient for microbatch {mb}, which this stage has not run")
            return False
        index, loss = msg.meta.get("index"), msg.meta.get("loss")
        if not isinstance(index, list) or any(type(i) is not int for i in index):
            raise MyelinError(
                f"rank {self.world.rank}: gradient of microbatch {mb} from rank {msg.src} has "
                f"meta.index={index!r}, expected a list of output positions"
            )
        if not isinstance(loss, float):
            raise MyelinError(
                f"rank {self.world.rank}: gradient of microbatch {mb} from rank {msg.src} has "
                f"meta.loss={loss!r}, expected a float"
            )
        self._arrived.add(("gradient", mb))
        self._grads[mb] = (msg.tensors, index, loss)
        ready.backward.add(mb)
        return True

    def _on_abort(self, msg: Message) -> None:
        """Another rank failed: raise its error here, as PeerLostError if a peer was lost."""
        if not 0 <= msg.src < self.world.layout.world_size or msg.src == self.world.rank:
            return self._reject(msg, f"abort from rank {msg.src}, which is not a peer")
        detail = str(msg.meta.get("error", "no detail"))
        lost = msg.meta.get("lost")
        if self.liveness is not None:
            self.liveness.check()  # this rank's own view of the loss comes first
        if type(lost) is int:
            doing = str(msg.meta.get("doing", "unknown"))
            raise PeerLostError(lost, doing, f"rank {msg.src} reports: {detail}")
        raise RemoteError(msg.src, detail)

    def _reject(self, msg: Message, reason: str) -> None:
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

    def _describe_wait(self, ready: Ready, waited: float, evaluating: bool = False) -> str:
        where = (
            f"rank {self.world.rank} (stage {self.stage.index}, replica {self.world.replica}) "
            f"waited {waited:.1f}s in step {self._step}"
        )
        if evaluating:
            missing = ready.next_missing_forward()
            if missing is not None:
                return (
                    f"{where} (evaluation) for the activation of microbatch {missing} "
                    f"from rank {self.world.peer(self.stage.index - 1)}"
                )
            last = self.world.peer(self.stage.num_stages - 1)
            return f"{where} (evaluation) for the loss from rank {last}"
        action = self.policy.waiting_for(ready)
        if action is None:
            return f"{where} with nothing left to wait for ({ready})"
        if action.kind == "F":
            peer, what = self.world.peer(action.stage - 1), "activation"
        else:
            peer, what = self.world.peer(action.stage + 1), "gradient"
        return (
            f"{where} for the {what} of microbatch {action.microbatch} from rank {peer} "
            f"(to run {action}); forwards done {ready.forwards_done}, backwards done "
            f"{ready.backwards_done} of {ready.microbatches}"
        )

    # -- end of step -------------------------------------------------------------

    def _sum_tied(self) -> None:
        """Sum the gradients of parameters that several stages hold (a tied embedding),
        so each holder applies the same update and the copies stay equal."""
        for group, params in self.tied:
            start = self.timeline.now()
            sum_gradients(params, group)
            self.timeline.add(
                "allreduce",
                f"{self.stage.index}TIED",
                start,
                self.timeline.now(),
                self._step,
                cause="collective_wait",
                track="collective",
            )

    def _average_replicas(self, loss: float, grads: bool = True) -> float:
        """Average gradients (when `grads`) and the loss across data-parallel replicas."""
        group = self.world.dp_group
        if group is None:
            return loss
        train = grads and self.updater is not None
        params = [p for p in self.stage.module.parameters() if p.requires_grad] if train else []
        start = self.timeline.now()
        loss = average_gradients(params, loss, group, self.world.layout.data_parallel)
        self.timeline.add(
            "allreduce",
            f"{self.stage.index}ALLREDUCE",
            start,
            self.timeline.now(),
            self._step,
            cause="collective_wait",
            track="collective",
        )
        return loss
