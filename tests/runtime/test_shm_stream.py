"""Large messages through shared memory: many in flight, held or dropped, bytes exact.

Issue 11.4 (per-message cost) made the shared-memory path cheaper: the sender copies
with one memmove and looks at its inbox for returned slots every 2 MiB sent rather than
before every message; the receiver watches a slot with a plain weak reference rather
than a `weakref.finalize` (about 6 us a message). None of it may let a slot be written
under a tensor the receiver still holds, let memory grow, or let a forged location in.

Run: python3 -m pytest tests/runtime/test_shm_stream.py -q  (about 2 s)
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch
import zmq

from myelin.runtime import shm
from myelin.runtime.messages import Message, encode
from myelin.runtime.transport import Transport, TransportConfig

pytestmark = pytest.mark.skipif(not shm.SUPPORTED, reason="needs memfd_create (Linux)")

MiB = 2**20
THRESHOLD = 128 * 2**10


@pytest.fixture
def pair(transports) -> Callable[..., tuple[Transport, Transport]]:
    """Two transports (rank 0 and 1) in this process over ipc, closed after the test."""
    base = {"kind": "ipc", "shm_threshold_bytes": THRESHOLD, "linger_ms": 100}
    return lambda **kw: transports(TransportConfig(**{**base, **kw}))


def _pump(a: Transport, b: Transport, until: Callable[[], bool], got: list[Message]) -> None:
    deadline = time.monotonic() + 20
    while not until():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        got += b.poll(0.001)
        a.poll(0)


def _ready(a: Transport, b: Transport) -> None:
    """Exchange large messages until a's segment towards b carries them."""
    got: list[Message] = []
    for _ in range(50):
        a.send(1, Message("activation", 0, 0, 0, 0, [torch.zeros(THRESHOLD, dtype=torch.uint8)]))
        _pump(a, b, lambda: bool(got), got)
        got.clear()
        if a.stats.shm_messages:
            return
    raise AssertionError("shared memory never became ready")


def _payload(i: int) -> list[torch.Tensor]:
    """Message i's tensors: 1 MiB, odd byte counts, 4 MiB, strided and multi-tensor ones."""
    g = torch.Generator().manual_seed(i)

    def raw(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    kind = i % 5
    if kind == 0:
        return [raw(MiB)]
    if kind == 1:
        return [raw(MiB + 3)]  # an odd size: the next slot starts aligned all the same
    if kind == 2:
        return [raw(4 * MiB).view(torch.float32).view(1024, 1024)]
    if kind == 3:
        return [raw(512 * 640 * 4).view(torch.float32).view(512, 640).t()]  # not contiguous
    return [raw(3 * 65537 * 8).view(torch.int64), raw(MiB).view(torch.bfloat16)[::2]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Same dtypes, shapes and bits (random bits hold NaNs, which equal nothing)."""
    return len(got) == len(want) and all(
        g.dtype == w.dtype and g.shape == w.shape and torch.equal(_bits(g), _bits(w))
        for g, w in zip(got, want, strict=True)
    )


def test_a_stream_of_held_and_dropped_tensors_keeps_every_byte(pair):
    """48 messages in flight through a 48 MiB segment; every third is held (one only
    through a view of it) while later ones reuse the freed slots; nothing is overwritten,
    and once everything is dropped every slot comes back and no watcher is left."""
    budget = 24 * MiB
    a, b = pair(shm_bytes=48 * MiB, max_inflight_bytes=budget)
    _ready(a, b)
    shm_before = a.stats.shm_messages
    side = a._peers[1].shm
    held: dict[int, list[torch.Tensor]] = {}
    got: list[Message] = []
    for i in range(48):
        a.send(1, Message("activation", 0, 0, i, 0, _payload(i)))
        assert a._peers[1].inflight <= budget  # credits still bound what is in flight
    sent = 48
    seen: set[int] = set()

    def take() -> None:
        for m in got:
            seen.add(m.microbatch)
            assert _same(m.tensors, _payload(m.microbatch)), f"message {m.microbatch} differs"
            if m.microbatch % 3 == 0:
                tensors = m.tensors
                held[m.microbatch] = [tensors[0][1:]] if m.microbatch == 3 else tensors
        got.clear()

    _pump(a, b, lambda: take() or len(seen) == 48 and not a.pending_sends(), got)
    assert len(held) == 16
    for i in range(48, 60):  # a second wave into the slots the dropped ones gave back
        a.send(1, Message("activation", 0, 0, i, 0, _payload(i)))
    sent += 12
    _pump(a, b, lambda: take() or len(seen) == 60 and not a.pending_sends(), got)
    assert len(held) == 20
    assert b.stats.received_messages >= sent
    assert a.stats.shm_messages - shm_before >= sent // 2, "the stream did not use the segment"
    assert side.segment.committed <= side.segment.size
    for i, tensors in held.items():
        want = _payload(i)
        if i == 3:
            want = [want[0][1:]]
        assert _same(tensors, want), f"held message {i} was overwritten"
    del tensors
    held.clear()
    _pump(a, b, lambda: side.segment.slots.used == 0, got)
    assert not b._shm_in._watched, "a watcher outlived its tensor"


def test_receiving_registers_no_finalizer(pair):
    """The slot's watcher is a plain weak reference: `weakref.finalize` cost the receiver
    about 6 us a message (and grew its registry while tensors were held)."""
    a, b = pair()
    _ready(a, b)
    before = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    got: list[Message] = []
    for i in range(8):
        a.send(1, Message("activation", 0, 0, i, 0, [torch.full((THRESHOLD,), i)]))
    _pump(a, b, lambda: len(got) == 8, got)
    assert all(torch.equal(m.tensors[0], torch.full((THRESHOLD,), m.microbatch)) for m in got)
    assert len(weakref.finalize._registry) == before  # type: ignore[attr-defined]
    assert len(b._shm_in._watched) == 8


def test_a_slot_returns_when_its_last_view_dies_on_another_thread(pair):
    a, b = pair(shm_bytes=MiB)
    _ready(a, b)
    side = a._peers[1].shm
    got: list[Message] = []
    _pump(a, b, lambda: side.segment.slots.used == 0, got)
    want = torch.arange(600 * 1024 // 4, dtype=torch.int32)
    a.send(1, Message("activation", 0, 0, 1, 0, [want]))
    _pump(a, b, lambda: bool(got), got)
    view = got.pop().tensors[0][10:20]  # the message and its full tensor are gone
    _pump(a, b, lambda: True, got)
    time.sleep(0.02)
    a.poll(0.01)
    assert side.segment.slots.used > 0, "the slot went back while a view of it was alive"
    box = [view]
    del view
    dropper = threading.Thread(target=box.clear)
    dropper.start()
    dropper.join()
    _pump(a, b, lambda: side.segment.slots.used == 0, got)
    a.send(1, Message("activation", 0, 0, 2, 0, [want + 1]))
    _pump(a, b, lambda: bool(got), got)
    assert torch.equal(got[0].tensors[0], want + 1)


def test_segment_put_copies_strided_and_odd_tensors_exactly():
    segment = shm.Segment(16 * MiB)
    try:
        base = torch.arange(3 * 1000 * 7, dtype=torch.float64).view(3, 1000, 7)
        cases = [base.transpose(0, 2), base[:, ::3, 1:], torch.ones(MiB + 5, dtype=torch.uint8)]
        for t in cases:
            offset = segment.put(t)
            assert offset is not None and offset % shm.ALIGN == 0
            raw = torch.frombuffer(segment._map, dtype=torch.uint8)[offset : offset + t.nbytes]
            assert torch.equal(raw.view(t.dtype).view(t.shape), t)
            del raw
    finally:
        segment.close()


@pytest.mark.parametrize(
    "where",
    [
        "offset outside the segment",
        "unaligned offset",
        "wrong token",
    ],
)
def test_a_forged_location_is_rejected_and_named(pair, caplog, where):
    a, b = pair()
    _ready(a, b)
    token = b._shm_in.token_of(0)
    loc = {
        "offset outside the segment": [token, 1 << 40],
        "unaligned offset": [token, 4096 + 3],
        "wrong token": [token ^ 1, 4096],
    }[where]
    frames = encode(Message("activation", 0, 0, 0, 0, [torch.ones(THRESHOLD)]), lambda i, t: loc)
    forger = b.context.socket(zmq.PUSH)
    forger.connect(b.address)
    rejected = b.stats.rejected
    got: list[Message] = []
    with caplog.at_level(logging.WARNING, logger="myelin.runtime.transport"):
        forger.send_multipart(frames)
        _pump(a, b, lambda: b.stats.rejected > rejected, got)
    forger.close(linger=0)
    assert not got
    assert "tensors.shm" in caplog.text
    a.send(1, Message("activation", 0, 0, 5, 0, [torch.full((THRESHOLD,), 5.0)]))
    _pump(a, b, lambda: bool(got), got)
    assert torch.equal(got[0].tensors[0], torch.full((THRESHOLD,), 5.0))
