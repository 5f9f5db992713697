"""Whole messages through a shared-memory ring (runtime/ring.py) and its doorbell.

Issue 11.4 (per-message cost): on one host a message's header and small tensors skip
ZeroMQ's I/O threads. The ring must carry bytes exactly across wrap-arounds, keep order
when full, refuse records that break its rules without reading outside it, and a
receiver asleep in poll must be woken by the doorbell, not by its timeout.

Run: python3 -m pytest tests/runtime/test_ring.py -q  (about 5 s)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from myelin.errors import ConfigError
from myelin.runtime import ring as rings
from myelin.runtime import shm
from myelin.runtime.messages import Message
from myelin.runtime.transport import Transport, TransportConfig

pytestmark = pytest.mark.skipif(
    not (shm.SUPPORTED and rings.SUPPORTED), reason="rings need Linux memfd on x86-64"
)

PAGE = 4096


def _ring(size: int, max_frames: int = 8) -> tuple[rings.Writer, rings.Reader, bytearray]:
    """A writer and a reader over one plain buffer laid out as a segment's start."""
    buf = bytearray(PAGE + size)
    view = memoryview(buf)
    words, data = view[:PAGE].cast("Q"), view[PAGE:]
    return rings.Writer(words, data), rings.Reader(words, data, max_frames), buf


def _frames(seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 5, (1,), generator=g))
    sizes = torch.randint(0, 3000, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
            for n in sizes]


def test_records_round_trip_exactly_across_many_wraps():
    writer, reader, _ = _ring(1 << 16)
    sent = got = 0
    pending: list[list[bytes]] = []
    while got < 500:
        frames = _frames(sent)
        if sent < 500 and writer.put(frames):
            pending.append(frames)
            sent += 1
            continue
        taken = reader.take()
        assert taken is not None, "the writer found the ring full while nothing was in it"
        assert [bytes(f) for f in taken] == pending.pop(0)
        reader.advance()
        got += 1
    assert reader.take() is None and not writer.pending()
    assert writer._head > 10 * writer.size  # it wrapped many times


def test_a_full_ring_refuses_and_writes_nothing():
    writer, reader, buf = _ring(1 << 16)
    frame = b"x" * 1000
    count = 0
    while writer.put([frame]):
        count += 1
    assert 60 <= count <= 65  # 1,016-byte records in 64 KiB
    before = bytes(buf)
    assert not writer.put([frame])
    assert bytes(buf) == before
    assert reader.take() is not None
    reader.advance()
    assert writer.put([frame])  # room again once one record is read


def test_a_record_over_half_the_ring_does_not_fit():
    writer, reader, _ = _ring(1 << 16)
    assert writer.put([b"x" * 40_000]) is None  # never fits: the caller sends it otherwise
    assert reader.take() is None
    assert writer.put([b"x" * 30_000]) is True


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda words, data: words.__setitem__(8, 10**9), "not within"),
        (lambda words, data: data.__setitem__(slice(0, 4), (12).to_bytes(4, "little")), "length"),
        (lambda words, data: data.__setitem__(slice(4, 8), (99).to_bytes(4, "little")), "frames"),
        (lambda words, data: data.__setitem__(slice(8, 12), (9999).to_bytes(4, "little")),
         "overrun"),
    ],
)
def test_a_corrupt_record_is_an_error_not_a_read_outside(corrupt, match):
    writer, reader, buf = _ring(1 << 16, max_frames=4)
    assert writer.put([b"abc", b"defgh"])
    view = memoryview(buf)
    corrupt(view[:PAGE].cast("Q"), view[PAGE:])
    with pytest.raises(rings.RingError, match=match):
        reader.take()


def test_sleep_is_refused_while_a_record_waits_and_the_writer_sees_it():
    writer, reader, _ = _ring(1 << 16)
    assert reader.sleep() and writer.asleep()
    reader.wake()
    assert not writer.asleep()
    writer.put([b"hello"])
    assert not reader.sleep() and not writer.asleep()  # a record came: nobody sleeps


def test_returns_hand_back_offsets_in_order_and_refuse_when_full():
    words = memoryview(bytearray(PAGE)).cast("Q")
    giver, taker = rings.Returns(words), rings.Returns(words)
    for base in range(0, 3000, 300):  # many laps of its 448 entries
        assert all(giver.put(base + i) for i in range(300))
        assert taker.take() == list(range(base, base + 300))
    assert taker.take() == []
    while giver.put(7):
        pass
    assert len(taker.take()) == giver.capacity == 448
    words[32] += 10**6  # its head, far past what fits
    with pytest.raises(rings.RingError, match="returns"):
        taker.take()


# ---------------------------------------------------------------- through the transport


@pytest.fixture
def pair(transports) -> Callable[..., tuple[Transport, Transport]]:
    base = {"kind": "ipc", "linger_ms": 100, "shm_bytes": 8 << 20}
    return lambda **kw: transports(TransportConfig(**{**base, **kw}))


def _receive(b: Transport, count: int, a: Transport | None = None) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + 10
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} messages came"
        got += b.poll(0.001)
        if a is not None:
            a.poll(0)
    return got


def _warm(a: Transport, b: Transport) -> None:
    """One exchange, so a's segment (and its ring) towards b is mapped."""
    for _ in range(100):
        a.send(1, Message("activation", 0, 0, 0, 0, [torch.zeros(4)]))
        _receive(b, 1, a)
        if a._peers[1].shm.ring is not None:
            return
    raise AssertionError("the ring never became ready")


def test_messages_take_the_ring_and_keep_their_bytes(pair):
    a, b = pair()
    _warm(a, b)
    small = torch.randn(1024)
    big = torch.randn(256, 1024)  # over the threshold: a slot, the header in the ring
    before = a.stats.ring_messages
    a.send(1, Message("activation", 0, 3, 1, 0, [small, big], {"note": "x"}))
    (msg,) = _receive(b, 1, a)
    assert a.stats.ring_messages == before + 1
    assert (msg.step, msg.microbatch, msg.meta) == (3, 1, {"note": "x"})
    assert torch.equal(msg.tensors[0], small) and torch.equal(msg.tensors[1], big)


def test_a_full_ring_queues_and_keeps_the_order(pair):
    a, b = pair(ring_bytes=1 << 16)
    _warm(a, b)
    chunks = [torch.full((1024,), float(i)) for i in range(100)]  # 4 KiB each: 400 KiB
    for i, t in enumerate(chunks):
        a.send(1, Message("activation", 0, 0, i, 0, [t]))
    assert a.pending_sends() > 0  # the ring holds about 15 of them
    got = _receive(b, 100, a)
    assert [m.microbatch for m in got] == list(range(100))
    assert all(torch.equal(m.tensors[0], chunks[m.microbatch]) for m in got)


def test_order_holds_where_a_pair_moves_from_zeromq_to_its_ring(pair):
    a, b = pair()
    got: list[Message] = []
    for i in range(300):  # the first go over ZeroMQ while the segment is mapped, then the ring
        a.send(1, Message("activation", 0, 0, i, 0, [torch.full((256,), float(i))]))
        got += b.poll(0)
        a.poll(0)
    got += _receive(b, 300 - len(got), a)
    assert a.stats.ring_messages > 0 and a.stats.ring_messages < 300
    assert [m.microbatch for m in got] == list(range(300))


def test_without_a_ring_headers_go_over_zeromq(pair):
    a, b = pair(ring_bytes=0)
    for i in range(3):  # the first offers the segment, the later ones use its slots
        a.send(1, Message("activation", 0, 0, i, 0, [torch.randn(256, 1024)]))
        assert len(_receive(b, 1, a)) == 1
    assert a.stats.ring_messages == 0 and a.stats.shm_messages >= 1


def test_a_stream_reuses_the_slots_the_receiver_gives_straight_back(pair):
    a, b = pair()
    _warm(a, b)
    segment = a._peers[1].shm.segment
    size = 256 * 1024
    highest = 0
    for i in range(40):  # 10 MiB in all; each message dies as soon as it is taken
        t = torch.full((size // 4,), float(i))
        a.send(1, Message("activation", 0, 0, i, 0, [t]))
        (msg,) = _receive(b, 1, a)
        assert torch.equal(msg.tensors[0], t)
        del msg
        b.poll(0)  # its slot goes back now, through the segment, with no credit message
        highest = max(highest, *segment.slots._taken)
    assert highest < segment.slots.base + 3 * size  # two or three slots, reused in turn


def test_a_sleeping_receiver_is_woken_by_the_doorbell(pair):
    a, b = pair()
    _warm(a, b)
    for _ in range(20):  # let the credits owed go back, so nothing wakes b but the bell
        b.poll(0.001)
        a.poll(0.001)
    got: list[Message] = []
    waiter = threading.Thread(target=lambda: got.extend(b.poll(5.0)))
    start = time.monotonic()
    waiter.start()
    time.sleep(0.05)  # b is asleep in its poll by now
    a.send(1, Message("activation", 0, 0, 7, 0, [torch.ones(4)]))
    waiter.join(timeout=6)
    assert got and got[0].microbatch == 7
    assert time.monotonic() - start < 1.0  # the bell woke it, not the 5 s timeout


def test_a_ring_message_claiming_another_sender_is_rejected(pair):
    a, b = pair()
    _warm(a, b)
    ring = a._peers[1].shm.ring
    forged = Message("activation", 0, 0, 0, 0, [torch.zeros(4)])
    forged.src = 1  # rank 1 is the receiver itself
    from myelin.runtime.messages import encode

    assert ring.put(encode(forged))
    rejected = b.stats.rejected
    a.send(1, Message("activation", 0, 0, 5, 0, [torch.ones(4)]))
    got = _receive(b, 1, a)
    assert [m.microbatch for m in got] == [5]
    assert b.stats.rejected == rejected + 1


def test_a_corrupt_ring_is_dropped_and_the_sender_goes_back_to_zeromq(pair):
    a, b = pair()
    _warm(a, b)
    side = a._peers[1].shm
    side.segment.ring._words[8] = side.segment.ring._head + 10**9  # head far past tail
    b.poll(0.01)
    assert b.stats.rejected >= 1 and not b._bell.readers
    deadline = time.monotonic() + 5
    while side.ring is not None:  # the ring_off control message reaches the sender
        assert time.monotonic() < deadline
        a.poll(0.001)
    a.send(1, Message("activation", 0, 0, 4, 0, [torch.ones(4)]))
    (msg,) = _receive(b, 1, a)
    assert msg.microbatch == 4


@pytest.mark.parametrize(
    "field, value",
    [("ring_bytes", 1000), ("ring_bytes", 2**16 + 4), ("ring_bytes", 2.0**20), ("spin_us", -1.0)],
)
def test_bad_ring_settings_name_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        TransportConfig(**{field: value})
    assert f"TransportConfig.{field}={value!r}" in str(err.value)
