"""Hostile peers: a local process that is not a rank connects to a rank's inbox and sends
garbage and forgeries. Each bad message is dropped, counted and logged with its reason;
training goes on with exactly the losses of a clean run. Where the library falls short the
case is a strict xfail that says what happens and what should.

Run: python -m pytest -q tests/faults
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zmq
from torch import nn

from myelin.errors import DeadlineError
from myelin.runtime import shm
from myelin.runtime.departures import GRACE_S
from myelin.runtime.group import Layout, World
from myelin.runtime.loop import EventLoop, LoopConfig
from myelin.runtime.messages import Message, encode
from myelin.runtime.schedule import make_policy
from myelin.runtime.stage import Stage
from myelin.runtime.transport import Transport, TransportConfig
from tests._procs import Job, launch
from tests.workers.hostile import LIMITS, MIB, OVERSIZE, SHM_THRESHOLD, catalog

needs_shm = pytest.mark.skipif(not shm.SUPPORTED, reason="shared memory needs Linux memfd")
NO_AUTH = (
    "without CURVE (TransportConfig.curve defaults to off for ipc and loopback tcp) any local "
    "process can claim a rank's src, and "
)


# ---------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Job]:
    """Run hostile.py in a mode once per module: several tests read the same job."""
    done: dict[str, Job] = {}

    def run(mode: str) -> Job:
        if mode not in done:
            tmp = tmp_path_factory.mktemp(mode)
            env = {"MYELIN_RUN_DIR": str(tmp)}  # flight records of failing ranks go here
            done[mode] = launch(2, "hostile.py", [mode], tmp, timeout=180, env=env)
        return done[mode]

    return run


def _trained_exactly_like_a_clean_run(job: Job) -> None:
    assert job.returncode == 0, job.output[-5000:]
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    for rank, res in job.results.items():
        assert res["error"] is None, (rank, res["error"])
        assert res["losses"] == res["clean"], (rank, res["losses"], res["clean"])
    assert job.results[0]["clean"] == job.results[1]["clean"]


def test_flood_of_bad_messages_is_dropped_counted_logged_and_changes_nothing(job):
    job = job("flood")
    _trained_exactly_like_a_clean_run(job)
    sent = job.results[0]["attacker"]
    assert sent["total"] >= 300 and sent["rounds"] >= 10, sent
    lines = job.output.splitlines()
    for rank, res in job.results.items():
        assert res["clean_counters"]["transport_rejected"] == 0
        assert res["clean_counters"]["loop_rejected"] == 0
        assert res["transport_rejected"] > 0 and res["loop_rejected"] > 0, (rank, res)
        assert res["replayed"] == 20  # 5 steps x 4 microbatches, each sent twice
        mine = [line for line in lines if line.startswith(f"rank {rank}: ")]
        for attack in catalog(rank, 1, random.Random(0)):
            assert sent["sent"].get(attack.name, 0) > 0, attack.name
            if attack.reason:
                assert any(attack.reason in line for line in mine), (rank, attack.name)
        kind = "activation" if rank == 1 else "gradient"
        assert any(f"duplicate {kind} for microbatch" in line for line in mine), rank


@pytest.mark.slow  # 11 s; test_security's CURVE run shuts outsiders out in the default suite
def test_curve_refuses_the_attacker_forged_aborts_and_all(job):
    job = job("curve")
    _trained_exactly_like_a_clean_run(job)
    for res in job.results.values():
        assert res["transport_rejected"] == res["loop_rejected"] == 0, res
    tried = job.results[0]["attacker"]
    assert tried["total"] + tried["dropped"] >= 300, tried  # queued, or refused by ZeroMQ
    assert "refused a connection with an unknown CURVE key" in job.output


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=NO_AUTH
    + "EventLoop._handle (loop.py) raises RemoteError on any abort from a rank in range: a "
    "forged {'op': 'abort'} under the peer's rank stops training on every rank. Fix: "
    "authenticate peers on one host too (curve on by default, or a per-run secret in the "
    "header that only the launcher's ranks know)",
)
def test_forged_abort_does_not_stop_training(job):
    job = job("abort")
    _trained_exactly_like_a_clean_run(job)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=NO_AUTH
    + "Inbox._accept (inbox.py) takes the first activation for (step, microbatch) from the "
    "previous stage's rank: rank 1 trains step 0 on forged activations and drops rank 0's "
    "real ones as duplicates; its gradients for microbatches rank 0 has not run yet are "
    "dropped there, and the pipeline deadlocks until rank 0's DeadlineError (which comes "
    "only once the forgeries stop: see the deadline test below). Fix: as for the forged "
    "abort, authenticate peers on one host too",
)
def test_forged_activations_are_not_trained_on(job):
    job = job("forge")
    _trained_exactly_like_a_clean_run(job)


@pytest.mark.parametrize("mode", ["shape", pytest.param("dtype", marks=pytest.mark.slow)])
def test_wrong_activation_from_the_real_peer_fails_every_rank_fast(job, mode):
    job = job(mode)
    assert job.returncode != 0
    err = job.results[1]
    assert err["error_type"] is not None and err["elapsed"] < 30, err
    peer = job.results[0]
    assert peer["error_type"] == "RemoteError" and "rank 1 failed" in peer["error"], peer


@pytest.mark.parametrize(
    ("mode", "what"),
    [("shape", "2, 16, 31"), pytest.param("dtype", "int64", marks=pytest.mark.slow)],
)
def test_wrong_activation_error_names_microbatch_source_and_mismatch(job, mode, what):
    text = job(mode).results[1]["error"]
    for part in ("microbatch 2", "training step 2", "rank 0", what):
        assert part in text, (part, text)


# ---------------------------------------------------------------- one transport, attacked


@pytest.fixture
def pair() -> Iterator[tuple[Transport, Transport, zmq.Socket]]:
    """Ranks 0 and 1 in this process, and an attacker's socket (its own context) to rank 1."""
    store = dist.HashStore()
    cfg = TransportConfig(
        kind="ipc", limits=LIMITS, shm_threshold_bytes=SHM_THRESHOLD, shm_bytes=MIB, linger_ms=100
    )
    a, b = Transport(0, 2, store, cfg), Transport(1, 2, store, cfg)
    a.connect([1])
    b.connect([0])
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        yield a, b, raw
    finally:
        raw.close()
        ctx.term()
        a.close()
        b.close()


def _pump(*ts: Transport, until: Callable[[], bool], timeout: float = 5.0) -> list[Message]:
    """Poll every transport until `until()`; the messages that reached the last one."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        for t in ts[:-1]:
            t.poll(0.001)
        got += ts[-1].poll(0.001)
    return got


def _settle(*ts: Transport, seconds: float = 0.1) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for t in ts:
            t.poll(0.001)


def _ready_shm(a: Transport, b: Transport) -> None:
    """Send until a's segment towards b is mapped, then until every slot is back."""
    for i in range(50):
        a.send(1, Message("activation", 0, 0, i, 1, [torch.zeros(1024)]))
        _pump(a, b, until=lambda i=i: b.stats.received_messages > i)
        if a.stats.shm_messages:
            _pump(a, b, until=lambda: a._peers[1].shm.segment.slots.used == 0)
            return
    raise AssertionError("shared memory never became ready")


def _forge(raw: zmq.Socket, src: int, meta: dict[str, Any]) -> None:
    """A control message under another rank's name, made with myelin's own encoder."""
    raw.send_multipart(encode(Message("control", src, 0, 0, 0, [], meta)))


def _dropped_by_transport(by: str) -> list:
    return [a for a in catalog(1, 0, random.Random(0)) if a.by == by]


@pytest.mark.parametrize(
    "attack",
    _dropped_by_transport("decode") + [a for a in _dropped_by_transport("transport") if a.reason],
    ids=lambda a: a.name,
)
def test_bad_message_is_dropped_counted_once_and_logged(pair, caplog, attack):
    a, b, raw = pair
    raw.connect(b.address)
    caplog.set_level(logging.WARNING, logger="myelin.runtime.transport")
    raw.send_multipart(attack.frames)
    _pump(a, b, until=lambda: b.stats.rejected >= 1)
    _settle(a, b)
    assert b.stats.rejected == 1 and b.stats.received_messages == 0
    assert any(attack.reason in r.getMessage() for r in caplog.records), caplog.text
    t = torch.arange(2048, dtype=torch.float32)  # rank 1 still takes rank 0's messages
    a.send(1, Message("activation", 0, 0, 0, 1, [t]))
    assert torch.equal(_pump(a, b, until=lambda: b.stats.received_messages)[0].tensors[0], t)


CONTROL_ABUSE = [a for a in _dropped_by_transport("transport") if not a.reason]


@pytest.mark.parametrize("attack", CONTROL_ABUSE, ids=lambda a: a.name)
def test_abused_control_op_is_counted_and_changes_nothing(pair, attack):
    a, b, raw = pair
    raw.connect(b.address)
    b.send(0, Message("gradient", 1, 0, 0, 0, [torch.zeros(1024)]))  # rank 0 does not take it
    raw.send_multipart(attack.frames)
    _pump(b, until=lambda: b.stats.rejected >= 1)
    _settle(b)
    assert b.stats.rejected == 1 and b._peers[0].inflight == 4096


@pytest.mark.parametrize("attack", CONTROL_ABUSE, ids=lambda a: a.name)
def test_abused_control_op_is_logged(pair, caplog, attack):
    a, b, raw = pair
    raw.connect(b.address)
    caplog.set_level(logging.DEBUG, logger="myelin")
    raw.send_multipart(attack.frames)
    _pump(a, b, until=lambda: b.stats.rejected >= 1)
    assert any(r.levelno >= logging.WARNING for r in caplog.records), caplog.text


def test_frame_over_the_limit_is_cut_off_and_later_messages_arrive(pair):
    a, b, raw = pair
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(b.address)
    raw.send_multipart(OVERSIZE.frames)
    _settle(a, b, seconds=0.3)
    assert b.stats.received_messages == 0 and b.stats.received_bytes == 0
    t = torch.arange(2048, dtype=torch.float32)
    a.send(1, Message("activation", 0, 0, 0, 1, [t]))
    assert torch.equal(_pump(a, b, until=lambda: b.stats.received_messages)[0].tensors[0], t)


def test_frame_over_the_limit_is_counted_and_logged(pair, caplog):
    a, b, raw = pair
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(b.address)
    caplog.set_level(logging.WARNING, logger="myelin")
    raw.send_multipart(OVERSIZE.frames)
    _pump(a, b, until=lambda: b.stats.dropped_connections >= 1, timeout=2.0)
    assert b.stats.received_messages == 0

    def warned():
        return any("over MessageLimits" in r.getMessage() for r in caplog.records)

    assert not warned()  # not yet: a goodbye may still come to explain it (GRACE_S)
    _pump(a, b, until=warned, timeout=GRACE_S + 2.0)


def test_a_connection_closed_by_a_peer_that_said_goodbye_is_not_warned_of(pair, caplog):
    """A peer closing its trainer says goodbye on the heartbeats and closes its connection
    to this inbox: counted, but no warning (the warning is for peers cut off or gone)."""
    a, b, raw = pair
    caplog.set_level(logging.WARNING, logger="myelin")
    raw.connect(b.address)
    raw.send_multipart(encode(Message("activation", 0, 0, 0, 1, [torch.zeros(4)])))
    _pump(a, b, until=lambda: b.stats.received_messages + b.stats.rejected >= 1)
    b.closed.parted = lambda: 1  # what liveness answers once the peer's goodbye came
    raw.close()
    _pump(a, b, until=lambda: b.stats.dropped_connections >= 1, timeout=2.0)
    _settle(a, b, seconds=GRACE_S + 0.3)
    assert not [r for r in caplog.records if "inbox closed" in r.getMessage()], caplog.text


def test_forged_credit_cannot_lift_the_inflight_budget(pair):
    a, b, raw = pair
    raw.connect(a.address)
    a.send(1, Message("activation", 0, 0, 0, 1, [torch.zeros(512)]))  # b does not take it yet
    assert a._peers[1].inflight == 2048
    _forge(raw, 1, {"op": "credit", "bytes": 2**40})
    _pump(a, until=lambda: a.stats.rejected >= 1, timeout=2.0)
    assert a._peers[1].inflight == 2048


@needs_shm
def test_forged_free_cannot_recycle_a_slot_the_receiver_holds(pair):
    a, b, raw = pair
    raw.connect(a.address)
    _ready_shm(a, b)
    ones = torch.ones(1024)
    received = b.stats.received_messages
    a.send(1, Message("activation", 0, 0, 0, 1, [ones]))
    held = _pump(a, b, until=lambda: b.stats.received_messages > received)[-1].tensors[0]
    first = a._peers[1].shm.segment.slots.base  # the first slot, after the header and ring
    assert list(a._peers[1].shm.segment.slots._taken) == [first]  # first fit: guessable
    _forge(raw, 1, {"op": "credit", "bytes": 0, "free": [first]})
    _settle(a, b)
    a.send(1, Message("activation", 0, 0, 1, 1, [torch.full((1024,), 7.0)]))
    _pump(a, b, until=lambda: b.stats.received_messages > received + 1)
    assert torch.equal(held, ones), "the held tensor was overwritten"


@needs_shm
def test_forged_refusal_does_not_turn_shared_memory_off(pair):
    a, b, raw = pair
    raw.connect(a.address)
    _ready_shm(a, b)
    _forge(raw, 1, {"op": "shm_refused", "reason": "forged"})
    _settle(a, b)
    assert a._peers[1].shm.state == "ready" and a.stats.rejected == 1


@needs_shm
def test_forged_offer_does_not_replace_a_peers_segment(pair):
    a, b, raw = pair
    raw.connect(b.address)
    _ready_shm(a, b)
    forged = shm.Segment(MIB)
    try:
        _forge(raw, 0, {"op": "shm_offer", **forged.offer()})
        _settle(a, b, seconds=0.3)
        t = torch.arange(1024, dtype=torch.float32)
        received, rejected = b.stats.received_messages, b.stats.rejected
        assert rejected >= 1  # the forged offer itself was refused, and counted
        a.send(1, Message("activation", 0, 0, 9, 1, [t]))
        got = _pump(
            a, b, until=lambda: b.stats.received_messages > received or b.stats.rejected > rejected
        )
        assert got and torch.equal(got[0].tensors[0], t), f"lost: {b.stats}"
    finally:
        forged.close()


# ---------------------------------------------------------------- the loop's early buffer


class _Inbox:
    """A transport that delivers a fixed list of messages, one per poll, then `flood` (if
    any) for ever; it gives up with _StillWaiting after `give_up_s` seconds of polling."""

    def __init__(self, messages: list[Message], flood: Message | None = None) -> None:
        self.messages = list(messages)
        self.flood = flood
        self.give_up = time.monotonic() + 5.0

    def poll(self, timeout_s: float) -> list[Message]:
        if time.monotonic() > self.give_up:
            raise _StillWaiting("the loop was still waiting after 5 s")
        if self.messages:
            return [self.messages.pop(0)]
        if self.flood is not None:
            time.sleep(0.001)
            return [self.flood]
        return []

    def send(self, dst: int, msg: Message) -> None:
        pass

    def pending_sends(self) -> int:
        return 0


class _StillWaiting(Exception):
    pass


def _act(mb: int, step: int = 0, stage: int = 1) -> Message:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(mb))
    return Message("activation", 0, step, mb, stage, [x])


def _last_stage(inbox: _Inbox, m: int, timeout_s: float) -> EventLoop:
    world = World(rank=1, layout=Layout(2, 1), device=torch.device("cpu"))
    torch.manual_seed(0)
    stage = Stage(nn.Sequential(nn.Linear(4, 3)), 1, 2, world.device, F.cross_entropy)
    config = LoopConfig(microbatches=m, timeout_s=timeout_s, poll_s=0.001)
    return EventLoop(stage, world, inbox, make_policy("message-driven", 2), None, config)


def test_junk_does_not_hold_off_the_deadline():
    m = 3
    junk = _act(0, stage=0)  # for this step, but addressed to stage 0: dropped every time
    loop = _last_stage(_Inbox([_act(0)], flood=junk), m, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(DeadlineError, match="activation of microbatch 1"):
        loop.run_step(0, None, [torch.tensor([0, 1])] * m)
    assert time.monotonic() - start < 2.0 and loop.stats.rejected > 0


def test_messages_far_ahead_do_not_crowd_out_the_next_step():
    m = 3
    junk = [_act(0, step=10**9) for _ in range(4 * m)]
    inbox = _Inbox([_act(0), *junk, _act(1), _act(0, step=1), _act(2)])
    loop = _last_stage(inbox, m, timeout_s=0.5)
    targets = [torch.tensor([0, 1])] * m
    loop.run_step(0, None, targets)
    inbox.messages = [_act(1, step=1), _act(2, step=1)]
    try:
        loop.run_step(1, None, targets)
    except DeadlineError as exc:
        pytest.fail(f"the real activation was crowded out: {exc}")


def test_deadline_names_the_microbatch_that_never_came():
    m = 3
    loop = _last_stage(_Inbox([_act(1), _act(2)]), m, timeout_s=0.3)
    with pytest.raises(DeadlineError, match="activation of microbatch 0 from rank 0"):
        loop.run_step(0, None, [torch.tensor([0, 1])] * m)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


_FLOOD = """
import sys, zmq
header = open(sys.argv[1], "rb").read()
payload = bytes(1 << 20)
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.connect(sys.argv[2])
for _ in range(int(sys.argv[3])):
    sock.send_multipart([header, payload])
sock.close(linger=30000)
ctx.term()
"""


@pytest.mark.xfail(
    strict=True,
    reason="the in-flight byte budget (TransportConfig.max_inflight_bytes) binds only "
    "senders that honour credits: the inbox's ZeroMQ RCVHWM is 100_000 messages per "
    "connection and MAXMSGSIZE the tensor limit (8 GiB by default), so a process that "
    "ignores credits makes a rank that is busy computing buffer 256 MiB here (and up to "
    "100_000 x max_tensor_bytes per connection) against a 32 MiB budget. Fix: size RCVHWM "
    "from the budget (max_inflight_bytes // max frame, a few at least) and keep strangers "
    "out (CURVE)",
)
def test_a_sender_that_ignores_credits_cannot_make_a_rank_buffer_without_bound(tmp_path):
    store = dist.HashStore()
    cfg = TransportConfig(kind="ipc", limits=LIMITS, max_inflight_bytes=32 * MIB)
    b = Transport(1, 2, store, cfg)
    try:
        message = Message("activation", 99, 0, 0, 1, [torch.zeros(MIB // 4)])  # 1 MiB
        (tmp_path / "header").write_bytes(bytes(encode(message)[0]))
        before = _rss_mib()
        cmd = [sys.executable, "-c", _FLOOD, str(tmp_path / "header"), b.address, "256"]
        subprocess.run(cmd, timeout=60, check=True)  # b is busy: it does not poll meanwhile
        grown = _rss_mib() - before
        _pump(b, until=lambda: b.stats.rejected == 256, timeout=30)
        assert grown < 4 * 32, f"rank 1 buffered {grown:.0f} MiB for a 32 MiB budget"
    finally:
        b.close()
