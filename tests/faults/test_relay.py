"""A rank that failed because it lost a peer tells the others which peer: they raise
PeerLostError naming the lost rank, not a RemoteError about the teller (three ranks in one
process, heartbeats over real sockets)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from myelin.errors import PeerLostError, RemoteError
from myelin.replicas.hub_client import HUB_RANK
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.liveness import Liveness
from myelin.runtime.transport import Transport


def _ranks(world: int) -> tuple[list[Transport], list[Liveness]]:
    store = dist.HashStore()
    transports = [Transport(r, world, store, prefix="relay") for r in range(world)]
    lives: list[Liveness | None] = [None] * world

    def make(r: int) -> None:
        lives[r] = Liveness(
            r,
            world,
            lambda k: f"stage 0, replica {k}",
            store,
            transports[r],
            FlightRecorder(r),
            heartbeat_s=0.05,
            peer_timeout_s=30.0,
            exit_after_loss_s=None,
            connect_timeout_s=10.0,
            prefix="relay",
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert all(live is not None for live in lives)
    return transports, lives  # type: ignore[return-value]


def _close(transports, lives) -> None:
    for live in lives:
        live.close()
    for t in transports:
        t.close()


def _told(live: Liveness) -> Exception:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            live.check()
        except Exception as e:  # noqa: BLE001 - the error under test
            return e
        time.sleep(0.02)
    raise AssertionError("rank 0 was never told")


@pytest.mark.parametrize("lost", [1, HUB_RANK, None])
def test_a_goodbye_after_a_peer_loss_is_relayed_as_that_loss(lost):
    """A lost rank, or the EASGD hub (rank -1: the rank that started it sees its process
    gone first; the others were told "rank 2 failed", a RemoteError), is relayed as lost;
    any other failure as a RemoteError."""
    transports, lives = _ranks(3)
    try:
        if lost is not None:
            why = "rank 2 lost rank 1 (stage 0, replica 1)" if lost == 1 else "the hub exited"
            cause = PeerLostError(lost, "reducing gradients", why)
        else:
            cause = ValueError("a bad batch")
        lives[2].failed = cause
        lives[2].close()
        error = _told(lives[0])
        if lost is not None:
            assert type(error) is PeerLostError and error.rank == lost, error
            assert error.doing == "reducing gradients"
            assert f"rank 2 reports: PeerLostError: {why}" in str(error)
        else:
            assert type(error) is RemoteError and error.rank == 2, error
            assert "ValueError: a bad batch" in str(error)
    finally:
        _close(transports, lives)


@pytest.mark.parametrize("raised", ["PeerLostError", "RuntimeError"])
def test_a_script_that_ended_after_a_loss_relays_it_and_tells_no_failure(monkeypatch, raised):
    """Rank 2 lost rank 1, and its script ended with an error outside the trainer (the
    PeerLostError itself, or gloo's RuntimeError from a barrier of its own): its goodbye
    at exit names rank 1 for rank 0 to relay (it used to be relayed only from a trainer
    that sent an abort, so rank 0 blamed rank 2), and rank 2 does not tell its launcher
    it failed (the launcher named it as the rank that failed first)."""
    transports, lives = _ranks(3)
    told = []
    monkeypatch.setattr("myelin.runtime.liveness.tell_launcher", told.append)
    try:
        loss = PeerLostError(1, "reducing gradients", "rank 2 lost rank 1 (stage 0, replica 1)")
        lives[2].lost = loss
        lives[2].acknowledged = True  # (its script raised it: no escalation)
        error = loss if raised == "PeerLostError" else RuntimeError("Connection closed by peer")
        monkeypatch.setattr("sys.last_value", error, raising=False)
        lives[2]._close_at_exit()
        relayed = _told(lives[0])
        assert type(relayed) is PeerLostError and relayed.rank == 1, relayed
        assert f"rank 2 reports: {raised}" in str(relayed), relayed
        assert told == []
    finally:
        _close(transports, lives)


def test_a_script_that_ended_with_its_own_error_tells_its_launcher(monkeypatch):
    """No peer lost: the script's own error is this rank's failure, told to the launcher
    at once and to the peers as the rank lost."""
    transports, lives = _ranks(2)
    told = []
    monkeypatch.setattr("myelin.runtime.liveness.tell_launcher", told.append)
    try:
        monkeypatch.setattr("sys.last_value", ValueError("a bad batch"), raising=False)
        lives[1]._close_at_exit()
        error = _told(lives[0])
        assert type(error) is PeerLostError and error.rank == 1, error
        assert "it ended with an error: ValueError: a bad batch" in str(error), error
        assert told == ["failed 1"]
    finally:
        _close(transports, lives)


def test_news_of_what_a_rank_does_is_rate_limited_and_the_latest_arrives():
    """The loop says what it does a few times a step; beating on every change (and waking
    for every beat received) woke every rank's heartbeat and ZMQ threads ~10 times a 25 ms
    step, CPU taken from training when ranks share cores. Now at most one news beat per
    50 ms (and one per heartbeat_s) goes out, a rank reads its peers' beats when it wakes
    for its own, and the peers still learn the latest news. About 2 s."""
    transports, lives = _ranks(3)
    try:
        for live in lives[:2]:
            live.heartbeat_s = 1.0  # so what is counted is rank 0's news
        lives[2].heartbeat_s = 0.01  # a chatty peer: 100 beats a second to rank 1
        sent, woke = [], []
        beat, take = lives[0]._beat, lives[1]._take
        lives[0]._beat = lambda doing: (sent.append(time.monotonic()), beat(doing))
        lives[1]._take = lambda: (woke.append(time.monotonic()), take())
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < 1.0:  # a new thing to do every millisecond
            n += 1
            lives[0].flight.now(f"running 1F (forward of microbatch 0) in step {n}")
            time.sleep(0.001)
        last = f"running 1F (forward of microbatch 0) in step {n}"
        deadline = time.monotonic() + 5
        while lives[1]._peers[0].doing != last and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lives[1]._peers[0].doing == last  # the latest news arrived
        during = [t for t in sent if start <= t <= start + 1.0]
        assert 5 <= len(during) <= 30, len(during)  # was ~100 (one per 10 ms poll)
        wakes = [t for t in woke if start <= t <= start + 1.0]
        assert len(wakes) <= 30, len(wakes)  # was ~120: one per beat received
    finally:
        _close(transports, lives)


def test_a_rank_closing_after_its_peer_said_goodbye_sends_it_nothing():
    """A goodbye to a rank that closed its inbox cannot arrive: sending one only made the
    context's teardown wait out the socket's linger (200 ms a close, on the rank that closed
    last)."""
    transports, lives = _ranks(2)
    try:
        lives[1].close()
        transports[1].close()
        peer = lives[0]._peers[1]
        deadline = time.monotonic() + 10
        while not peer.left and time.monotonic() < deadline:
            time.sleep(0.02)
        assert peer.left
        sent, send = [], peer.sock.send
        peer.sock.send = lambda *a, **k: sent.append(a) or send(*a, **k)
        lives[0].close()
        assert sent == []
    finally:
        _close(transports, lives)
