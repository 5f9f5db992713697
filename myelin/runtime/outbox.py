"""Outputs handed to the transport without waiting, so sends overlap the next operation.

On a CPU a message goes to the transport at once. On a GPU the device-to-host copy runs
on a side stream into a pinned staging buffer (from a pool, so nothing is pinned in the
hot path), and the message leaves once the copy's event has fired; the loop flushes
what is ready between operations. At a step's end every copy is waited for, and the
staging buffers go back to the pool once the step's sends have left. Each send is a
`send` span on the track of its peer, named `1SEND_F3` style.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from myelin.errors import DeadlineError
from myelin.offload.pool import HostPool
from myelin.profile.timeline import Timeline
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import World
from myelin.runtime.messages import Message

__all__ = ["Outbox", "message_span"]


class Outbox:
    """One rank's outgoing activations and gradients."""

    def __init__(
        self,
        stage: int,
        device: torch.device,
        world: World,
        transport: Any,
        timeline: Timeline,
        flight: FlightRecorder,
    ) -> None:
        self.stage = stage
        self.device = device
        self.world = world
        self.transport = transport
        self.timeline = timeline
        self.flight = flight
        self._queue: list[tuple[Any, int, Message]] = []  # (copy event, dst, message)
        cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._staging = HostPool(pin=True, slab_bytes=16 << 20) if cuda else None
        self._staged: list[torch.Tensor] = []

    @property
    def copying(self) -> bool:
        """Whether messages wait for their device-to-host copies."""
        return bool(self._queue)

    def send(
        self, step: int, to_stage: int, kind: str, mb: int, tensors: list[torch.Tensor], meta: dict
    ) -> None:
        """Send `tensors` to stage `to_stage` of this replica: now, or once copied to the host."""
        dst = self.world.peer(to_stage)
        if self._copy_stream is None:
            self._transmit(dst, Message(kind, self.world.rank, step, mb, to_stage, tensors, meta))
            return
        # On a GPU the device-to-host copy runs on a side stream; the send leaves once
        # the copy's event fires, so the next operation's compute overlaps it.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
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
        msg = Message(kind, self.world.rank, step, mb, to_stage, host, meta)
        self._queue.append((event, dst, msg))

    def _transmit(self, dst: int, msg: Message) -> None:
        start = self.timeline.now()
        self.transport.send(dst, msg)
        self.flight.note("send %s of microbatch %d to rank %d", msg.kind, msg.microbatch, dst)
        if self.timeline.enabled:
            nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
            message_span(self.timeline, self.stage, "send", msg, dst, start, msg.step, nbytes)

    def flush(self) -> None:
        """Hand over the messages whose copies have finished, in order."""
        while self._queue and self._queue[0][0].query():
            _, dst, msg = self._queue.pop(0)
            self._transmit(dst, msg)

    def finish_copies(self) -> None:
        """Wait for every pending copy and hand its message over (at a step's end)."""
        for event, _, _ in self._queue:
            event.synchronize()
        self.flush()

    def drain(self, step: str, timeout_s: float, inbox: Any) -> None:
        """Wait until this step's messages have left (the `inbox` takes what arrives
        meanwhile), so none is stranded at the step's end; then release the staging."""
        deadline = time.monotonic() + timeout_s
        self.finish_copies()
        while self.transport.pending_sends():
            if time.monotonic() > deadline:
                raise DeadlineError(
                    f"rank {self.world.rank} (stage {self.stage}): the messages of {step} "
                    f"were not taken by their peers within {timeout_s:.0f}s"
                )
            inbox.handle(inbox.wait(0.001), None)
        self.release()

    def release(self) -> None:
        """Give the staging buffers back, once the step's messages have left."""
        for buf in self._staged:
            self._staging.free(buf)
        self._staged.clear()


def message_span(
    timeline: Timeline,
    stage: int,
    kind: str,
    msg: Message,
    peer: int,
    start: float,
    step: int,
    nbytes: int = 0,
) -> None:
    """Record a `send` or `recv` of `msg` on the track of `peer`, named `1SEND_F3` style."""
    op = "SEND" if kind == "send" else "RECV"
    name = f"{stage}{op}_{'F' if msg.kind == 'activation' else 'B'}{msg.microbatch}"
    fields: dict[str, Any] = {"nbytes": nbytes} if nbytes else {}
    timeline.add(
        kind,
        name,
        start,
        timeline.now(),
        step,
        microbatch=msg.microbatch,
        peer=peer,
        track=f"peer {peer}",
        **fields,
    )
