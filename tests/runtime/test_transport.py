"""The ZeroMQ transport: exact bytes, credits, shared-memory slots, cleanup, bad input.

Run: python3 -m pytest tests/runtime/test_transport.py -q
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zmq

from myelin.errors import ConfigError
from myelin.runtime import shm
from myelin.runtime.messages import DTYPES, Message, encode
from myelin.runtime.transport import Transport, TransportConfig

KINDS = ["ipc", "tcp"]
SHM_THRESHOLD = 128 * 2**10  # apart from ZeroMQ's 64 KiB copy threshold, so both are crossed
needs_shm = pytest.mark.skipif(not shm.SUPPORTED, reason="shared memory needs Linux memfd")


# ---------------------------------------------------------------- helpers


def _config(**kw: Any) -> TransportConfig:
    base = {"shm_threshold_bytes": SHM_THRESHOLD, "shm_bytes": 8 << 20, "linger_ms": 100}
    return TransportConfig(**{**base, **kw})


@pytest.fixture
def make_pair(transports) -> Callable[..., tuple[Transport, Transport]]:
    """Two transports (rank 0 and 1) in this process, closed after the test."""
    return lambda kind="ipc", **kw: transports(_config(kind=kind, **kw))


def _pump(
    *ts: Transport, until: Callable[[dict], bool], timeout: float = 10.0
) -> dict[Transport, list[Message]]:
    """Poll every transport until `until(received)` holds; fail after `timeout` seconds."""
    got: dict[Transport, list[Message]] = {t: [] for t in ts}
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, "condition not met before the deadline"
        for t in ts:
            got[t] += t.poll(0.001)
    return got


def _exchange(a: Transport, b: Transport, message: Message) -> Message:
    """Send from a to b and return what b received."""
    a.send(b.rank, message)
    got = _pump(a, b, until=lambda got: got[b])[b]
    assert len(got) == 1
    return got[0]


def _ready_shm(a: Transport, b: Transport) -> None:
    """Send large messages until a's segment towards b is mapped, so shm carries the next."""
    big = torch.zeros(SHM_THRESHOLD, dtype=torch.uint8)
    for _ in range(50):
        _exchange(a, b, Message("activation", a.rank, 0, 0, 0, [big]))
        if a.stats.shm_messages:
            return
    raise AssertionError("shared memory never became ready")


def _slots_used(t: Transport, dst: int) -> int:
    return t._peers[dst].shm.segment.slots.used


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of `dtype` (NaNs included for floats); bools are 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want))
    )


def _cases() -> list[torch.Tensor]:
    """Every dtype, 0-d, empty and strided tensors, sizes either side of both thresholds."""
    tensors = [_random(dtype, (3, 5), i) for i, dtype in enumerate(DTYPES.values())]
    tensors += [_random(dtype, (), 50 + i) for i, dtype in enumerate(DTYPES.values())]
    tensors += [torch.empty(0, dtype=torch.float32), torch.empty(4, 0, 3, dtype=torch.bfloat16)]
    for n in (zmq.COPY_THRESHOLD - 1, zmq.COPY_THRESHOLD, SHM_THRESHOLD - 1, SHM_THRESHOLD):
        tensors.append(_random(torch.uint8, (n,), n))
    tensors.append(_random(torch.bfloat16, (512, 1024), 7))  # 1 MiB
    tensors.append(_random(torch.bool, (3, SHM_THRESHOLD), 8))
    tensors.append(_random(torch.float32, (64, 1024), 9).t())  # not contiguous
    return tensors


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_round_trip_exactly(make_pair, kind):
    a, b = make_pair(kind)
    if kind == "ipc" and shm.SUPPORTED:
        _ready_shm(a, b)
    cases = _cases()
    for i in range(0, len(cases), 5):  # several tensors per message, mixed paths
        sent = cases[i : i + 5]
        got = _exchange(a, b, Message("activation", 0, 3, i, 1, sent, {"i": i}))
        assert (got.src, got.step, got.microbatch, got.stage, got.meta) == (0, 3, i, 1, {"i": i})
        assert all(_same(g, s) for g, s in zip(got.tensors, sent, strict=True))
    uses_shm = kind == "ipc" and shm.SUPPORTED
    assert (a.stats.shm_messages > 1) == uses_shm
    reply = _exchange(b, a, Message("gradient", 1, 0, 0, 0, cases[-2:]))
    assert all(_same(g, s) for g, s in zip(reply.tensors, cases[-2:], strict=True))


def test_shm_off_and_refused_offers_still_deliver(make_pair):
    a, b = make_pair("ipc", shm=False)
    big = _random(torch.float32, (SHM_THRESHOLD,), 1)
    for _ in range(3):
        assert _same(_exchange(a, b, Message("activation", 0, 0, 0, 0, [big])).tensors[0], big)
    assert a.stats.shm_messages == 0
    store = dist.HashStore()
    sender = Transport(0, 2, store, _config())
    receiver = Transport(1, 2, store, _config(shm=False))
    try:
        for _ in range(3):
            got = _exchange(sender, receiver, Message("activation", 0, 0, 0, 0, [big]))
            assert _same(got.tensors[0], big)
        assert sender.stats.shm_messages == 0
    finally:
        sender.close()
        receiver.close()


def test_three_ranks_all_to_all_over_their_own_segments():
    store = dist.HashStore()
    ts = [Transport(r, 3, store, _config()) for r in range(3)]
    try:
        for rnd in range(4):  # the first round offers segments, later rounds ride them
            want = {}
            for src, dst in [(s, d) for s in range(3) for d in range(3) if s != d]:
                want[(src, dst)] = _random(torch.float32, (SHM_THRESHOLD // 2 + src + dst,), rnd)
                ts[src].send(dst, Message("activation", src, rnd, dst, 0, [want[(src, dst)]]))
            got = _pump(*ts, until=lambda got: sum(map(len, got.values())) == 6)
            for dst, t in enumerate(ts):
                assert sorted(m.src for m in got[t]) == [s for s in range(3) if s != dst]
                assert all(_same(m.tensors[0], want[(m.src, dst)]) for m in got[t])
        assert all(t.stats.shm_messages >= 4 for t in ts) == shm.SUPPORTED
    finally:
        for t in ts:
            t.close()


# ---------------------------------------------------------------- credits


@pytest.mark.parametrize("use_shm", [False, True])
def test_credits_bound_inflight_and_queue_keeps_order(make_pair, use_shm):
    budget = 1 << 20
    a, b = make_pair("ipc", max_inflight_bytes=budget, shm=use_shm)
    a.connect([1])
    peer = a._peers[1]
    chunk = torch.ones(300 * 1024, dtype=torch.uint8)
    for i in range(10):
        a.send(1, Message("activation", 0, 0, i, 0, [chunk * i]))
        assert peer.inflight <= budget
    assert a.pending_sends() >= 7  # 3 x 300 KiB fit in 1 MiB, the rest wait for credits
    assert a.stats.queued_for_credits >= 7
    got: list[Message] = []
    deadline = time.monotonic() + 10
    while len(got) < 10:
        assert time.monotonic() < deadline
        got += b.poll(0.001)
        a.poll(0.001)
        assert peer.inflight <= budget
    assert [m.microbatch for m in got] == list(range(10))
    assert all(torch.equal(m.tensors[0], chunk * m.microbatch) for m in got)
    del got
    _pump(a, b, until=lambda got: peer.inflight == 0)
    lone = torch.ones(3 * budget // 2, dtype=torch.uint8)  # bigger than the whole budget
    a.send(1, Message("activation", 0, 0, 98, 0, [lone]))  # goes alone, nothing else in flight
    assert peer.inflight == lone.numel()
    a.send(1, Message("activation", 0, 0, 99, 0, [chunk]))  # waits behind it
    assert peer.inflight == lone.numel() and a.pending_sends() >= 1
    got = _pump(a, b, until=lambda got: len(got[b]) == 2)[b]
    assert [m.microbatch for m in got] == [98, 99]
    assert torch.equal(got[0].tensors[0], lone) and torch.equal(got[1].tensors[0], chunk)


# ---------------------------------------------------------------- shared memory


@needs_shm
def test_shm_slot_is_not_reused_while_receiver_holds_the_tensor(make_pair):
    a, b = make_pair("ipc", shm_bytes=1 << 20, shm_wait_s=0.05)
    _ready_shm(a, b)
    _pump(a, b, until=lambda got: _slots_used(a, 1) == 0)
    src = torch.full((600 * 1024,), 1, dtype=torch.uint8)
    a.send(1, Message("activation", 0, 0, 1, 0, [src]))
    src.fill_(9)  # the sender's buffer is free once send returns: shm copied it
    held = _pump(a, b, until=lambda got: got[b])[b][0].tensors[0]
    assert a.stats.shm_messages >= 2 and torch.equal(held, torch.full_like(held, 1))
    for value in (2, 3):  # no room beside the held slot: these must go inline, not over it
        other = torch.full((600 * 1024,), value, dtype=torch.uint8)
        got = _exchange(a, b, Message("activation", 0, 0, value, 0, [other])).tensors[0]
        assert torch.equal(got, other)
        assert torch.equal(held, torch.full_like(held, 1)), "a held slot was overwritten"
    assert a.stats.shm_fallbacks == 2
    shm_before = a.stats.shm_messages
    del held, got
    _pump(a, b, until=lambda got: _slots_used(a, 1) == 0)
    again = torch.full((600 * 1024,), 4, dtype=torch.uint8)
    assert torch.equal(
        _exchange(a, b, Message("activation", 0, 0, 4, 0, [again])).tensors[0], again
    )
    assert a.stats.shm_messages == shm_before + 1  # the freed slot carries data again


@needs_shm
def test_shm_stream_waits_for_slots_instead_of_falling_back(make_pair):
    a, b = make_pair("ipc", shm_bytes=1 << 20)
    _ready_shm(a, b)
    start = a.stats.shm_messages
    tensors = [_random(torch.uint8, (400 * 1024,), i) for i in range(12)]
    for i, t in enumerate(tensors):  # 12 x 400 KiB through a 1 MiB segment
        a.send(1, Message("activation", 0, 0, i, 0, [t]))
    checked: list[tuple[int, bool]] = []
    deadline = time.monotonic() + 10
    while len(checked) < len(tensors):
        assert time.monotonic() < deadline
        checked += [
            (m.microbatch, _same(m.tensors[0], tensors[m.microbatch])) for m in b.poll(0.001)
        ]
        a.poll(0.001)
    assert checked == [(i, True) for i in range(12)]
    assert a.stats.shm_messages - start == 12 and a.stats.shm_fallbacks == 0


def test_slot_allocator_aligns_merges_and_refuses():
    slots = shm.SlotAllocator(4096, 1024, align=64)
    x, y, z = slots.alloc(1), slots.alloc(100), slots.alloc(64)
    assert (x, y, z) == (4096, 4160, 4288)
    assert slots.alloc(1024) is None
    slots.free(y)
    slots.free(x)
    assert slots.alloc(192) == 4096  # x and y merged back into one range
    with pytest.raises(KeyError):
        slots.free(y + 1)
    slots.free(4096)
    slots.free(z)
    assert slots.used == 0 and slots.alloc(1024) == 4096


# ---------------------------------------------------------------- cleanup, bad input


def _shm_in_use() -> list[str]:
    """This process's open descriptors and mappings of myelin segments."""
    gc.collect()
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    return [x for x in fds + maps if "myelin-shm" in x]


def _shm_files() -> set[str]:
    return (
        {n for n in os.listdir("/dev/shm") if "myelin" in n} if os.path.isdir("/dev/shm") else set()
    )


@pytest.mark.parametrize("ipc_dir", [None, "sock"])
def test_close_leaves_no_socket_or_segment(tmp_path, monkeypatch, ipc_dir):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a fallback would go
    before = _shm_files()
    store = dist.HashStore()
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir()
    cfg = _config(ipc_dir=str(sock_dir) if ipc_dir else None)
    a, b = Transport(0, 2, store, cfg), Transport(1, 2, store, cfg)
    if ipc_dir:
        assert a.address.startswith(f"ipc://{sock_dir}") and len(os.listdir(sock_dir)) == 2
    if shm.SUPPORTED:
        _ready_shm(a, b)
        _ready_shm(b, a)
        assert _shm_in_use()
    a.close()
    b.close()
    a.close()  # twice is fine
    assert _shm_in_use() == []
    assert os.listdir(sock_dir) == [] and os.listdir(tmp_path) == ["sock"]
    assert _shm_files() <= before


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", "udp"),
        ("max_inflight_bytes", 0),
        ("linger_ms", -1),
        ("connect_timeout_s", 0),
        ("shm", "yes"),
        ("shm_threshold_bytes", 0),
        ("shm_bytes", 1024),
        ("shm_bytes", 2.5),
        ("shm_wait_s", -1.0),
        ("ipc_dir", ""),
    ],
)
def test_bad_config_names_the_field_and_value(field, value):
    with pytest.raises(ConfigError) as err:
        TransportConfig(**{field: value})
    assert f"TransportConfig.{field}={value!r}" in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_garbage_frames_are_counted_and_do_not_break_later_messages(make_pair, kind):
    a, b = make_pair(kind)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(b.address)
    try:
        raw.send(b"\xc1 not msgpack")
        raw.send_multipart([b"\x92\x01\x02", b"tensor without a header"])
        raw.send(b"\x81\xa4kind\xa7control")  # msgpack, but not a header
        forged = Message("activation", 0, 0, 0, 0, [torch.ones(SHM_THRESHOLD)])
        raw.send(encode(forged, place=lambda i, t: [1, 4096])[0])  # a segment never offered
        bogus_offer = {"op": "shm_offer", "pid": os.getpid(), "fd": 0, "size": 1 << 20, "token": 7}
        raw.send(encode(Message("control", 0, 0, 0, 0, [], bogus_offer))[0])
        # b refuses the offer; rank 0 (a), which offered nothing, drops the refusal
        _pump(a, b, until=lambda got: b.stats.rejected >= 4 and a.stats.rejected >= 1)
    finally:
        raw.close()
        ctx.term()
    t = _random(torch.float16, (64, 64), 3)
    assert _same(_exchange(a, b, Message("activation", 0, 0, 0, 0, [t])).tensors[0], t)
    assert b.stats.rejected == 4 and b.stats.received_messages == 1
    assert a.stats.rejected == 1


def test_ipc_path_over_107_bytes_falls_back_to_tmp(tmp_path):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    store = dist.HashStore()
    cfg = _config(ipc_dir=str(deep))
    a, b = Transport(0, 2, store, cfg), Transport(1, 2, store, cfg)
    try:
        path = b.address.removeprefix("ipc://")
        assert len(path.encode()) <= 107 and path.startswith("/tmp/")
        t = torch.arange(10)
        assert torch.equal(_exchange(a, b, Message("activation", 0, 0, 0, 0, [t])).tensors[0], t)
    finally:
        a.close()
        b.close()
    assert not os.path.exists(path)


# ---------------------------------------------------------------- two real processes


def _worker(rank: int, port: int) -> None:
    """Over ipc, then tcp: rank 0 sends every case, rank 1 checks and echoes it back."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    cases = _cases()
    for kind in KINDS:
        t = Transport(rank, 2, store, _config(kind=kind), prefix=kind)

        def recv(t: Transport = t) -> Message:
            while not (got := t.poll(1.0)):
                pass
            return got[0]

        ok = True
        for i, case in enumerate(cases * 2):  # twice: the second pass rides shm on ipc
            if rank == 0:
                t.send(1, Message("activation", 0, 0, i, 0, [case]))
                ok &= _same(recv().tensors[0], case)
            else:
                msg = recv()
                ok &= msg.microbatch == i and _same(msg.tensors[0], case)
                t.send(0, Message("gradient", 1, 0, i, 0, msg.tensors))
        while t.pending_sends():
            t.poll(0.01)
        store.set(f"{kind}/{rank}", f"{ok} {t.stats.shm_messages}")
        if kind == "tcp":
            t.close()  # the ipc transport stays open, segments mapped, until the kill
    time.sleep(60)


def test_two_processes_exchange_exactly_and_a_kill_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers' temp directory, checked below
    before = _shm_files()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, store.port), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        keys = [f"{kind}/{r}" for kind in KINDS for r in (0, 1)]
        store.wait(keys, timedelta(seconds=40))
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)
        results = {key: store.get(key).decode().split() for key in keys}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert all(ok == "True" for ok, _ in results.values()), results
    shm_used = [int(n) > 0 for _, n in results.values()]
    assert shm_used == [shm.SUPPORTED] * 2 + [False] * 2, results
    assert os.listdir(tmp_path) == [] and _shm_files() <= before
