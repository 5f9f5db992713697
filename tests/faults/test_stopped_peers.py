"""Ranks a launcher stops together (Ctrl-C, SIGTERM) do not blame each other, and errors
say where a rank was (issue 11's review).

Before: a 3-rank checkpoint save interrupted by Ctrl-C could end with a RemoteError
blaming rank 0's KeyboardInterrupt (a peer's goodbye replaced the rank's own interrupt),
and a rank in a save or in user code after an evaluation was described as "in evaluation
step N" (the last loop op). Heartbeats over real sockets, ranks in one process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from myelin.errors import MyelinError, PeerLeftError, PeerLostError, RemoteError
from myelin.failures import Failures
from myelin.profile.timeline import Timeline
from myelin.runtime import launched
from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import Layout, World
from myelin.runtime.inbox import Inbox
from myelin.runtime.liveness import STOP_GRACE_S
from myelin.runtime.loop import LoopStats
from myelin.runtime.messages import Message
from myelin.runtime.stage import Stage
from tests.faults.test_relay import _close, _ranks, _told


def _stopped_goodbye(lives, transports) -> None:
    """Rank 1 is stopped by its launcher in a save: its trainer told its peers."""
    lives[1].stopped = True
    lives[1].failed = KeyboardInterrupt("rank 1 interrupted while in a checkpoint save")
    lives[1].close()
    transports[1].close()


def test_a_peer_stopped_with_this_rank_is_no_news():
    transports, lives = _ranks(2)
    try:
        lives[0].stopped = True  # the same Ctrl-C reached rank 0
        _stopped_goodbye(lives, transports)
        time.sleep(0.3)
        lives[0].check("a checkpoint save", strict=True)  # in the grace: not "it left"
        time.sleep(2 * STOP_GRACE_S)
        lives[0].check()  # nothing to raise: rank 0's own interrupt is its error
        assert lives[0].lost is None
        # a save rank 0 tries anyway (an emergency checkpoint) ends at once, naming rank 1
        with pytest.raises(PeerLeftError, match=r"but rank 1 \(.*\) was stopped and left"):
            lives[0].check("a checkpoint save", strict=True)
    finally:
        _close(transports[:1], lives[:1])


def test_a_peer_stopped_alone_is_news_after_the_grace():
    transports, lives = _ranks(2)
    try:
        closed = time.monotonic()
        _stopped_goodbye(lives, transports)
        time.sleep(0.3)
        assert lives[0].lost is None  # rank 0's own signal may still be on its way
        lives[0].check("a checkpoint save", strict=True)  # and rank 1 did not "leave"
        error = _told(lives[0])
        assert time.monotonic() - closed >= STOP_GRACE_S
        assert isinstance(error, RemoteError) and error.rank == 1, error
        assert "KeyboardInterrupt" in str(error)
    finally:
        _close(transports[:1], lives[:1])


@pytest.fixture
def rank0(tmp_path, monkeypatch):
    """Rank 0's Failures among two ranks with real heartbeats, and what it tells its
    launcher and sends its peers."""
    transports, lives = _ranks(2)
    told, sent = [], []
    monkeypatch.setattr(launched, "tell", told.append)
    failures = Failures(0, 2, tmp_path)
    failures.connected(transports[0], lives[0], None)
    transports[0].send_control = lambda r, meta: sent.append((r, meta))
    yield failures, lives[0], told, sent
    _close(transports, lives)


def test_an_interrupted_rank_keeps_its_interrupt_and_does_not_fail_first(rank0):
    """A peer's error heard of meanwhile does not replace the rank's KeyboardInterrupt; the
    launcher is not told this rank failed; the peers' abort says it was stopped."""
    failures, live, told, sent = rank0
    live.lost = RemoteError(1, "KeyboardInterrupt: rank 1 interrupted")
    error = failures.fail(KeyboardInterrupt("rank 0 interrupted"), "a checkpoint save")
    assert isinstance(error, KeyboardInterrupt) and "rank 0" in str(error)
    assert told == []  # not "failed 0": the launcher stopped it
    assert [(r, m["op"], m["stopped"]) for r, m in sent] == [(1, "abort", True)]
    assert live.stopped  # (Python's own handler raised it: no myelin handler ran)


def test_a_stopped_rank_that_saw_a_loss_relays_it_as_news(rank0):
    """Stopped by SIGTERM after it lost rank 1: the abort relays the loss, not a stop, so
    the peers raise it at once rather than after the grace."""
    failures, live, _, sent = rank0
    live.stopped = True
    live.lost = PeerLostError(1, "running 1F0", "rank 0 lost rank 1: its process is gone")
    error = failures.fail(MyelinError("rank 0 was stopped (SIGTERM)"), "training step 3")
    assert isinstance(error, PeerLostError) and error.rank == 1
    assert [(m["lost"], m["stopped"]) for _, m in sent] == [(1, False)]


def test_a_peer_gone_is_named_before_a_stopped_peer_whose_grace_ended():
    transports, lives = _ranks(3)
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        peers = lives[0]._peers
        peers[2].pid = gone.pid  # rank 2's process is gone
        peers[1].stopped_at = time.monotonic() - 2 * STOP_GRACE_S  # rank 1's grace is over
        lives[0]._peer_stopped = (peers[1], {"told": True}, "KeyboardInterrupt: rank 1")
        lives[0]._look(time.monotonic(), beats=False)
        assert isinstance(lives[0].lost, PeerLostError) and lives[0].lost.rank == 2
    finally:
        _close(transports, lives)


def test_a_real_failure_is_still_told_to_the_launcher(rank0):
    failures, _, told, sent = rank0
    error = failures.fail(ValueError("a bad batch"), "training step 2")
    assert isinstance(error, ValueError)
    assert told[0] == "failed 0"
    assert [(m["op"], m["stopped"]) for _, m in sent] == [("abort", False)]


class _FakeLiveness:
    """A liveness of a rank not yet stopped itself, with nothing lost (or, `lost_at`, a
    loss that shows at that call of `check`)."""

    stopped = False

    def __init__(self, lost_at: int = 0) -> None:
        self.calls, self.lost_at = 0, lost_at

    def check(self) -> None:
        self.calls += 1
        if self.calls == self.lost_at:
            raise PeerLostError(2, "reducing gradients", "rank 0 lost rank 2: its process is gone")


def _inbox(liveness: _FakeLiveness | None = None) -> Inbox:
    world = World(rank=0, layout=Layout(2, 1), device=torch.device("cpu"))
    stage = Stage(torch.nn.Linear(2, 2), 0, 2, world.device, torch.nn.functional.mse_loss)
    return Inbox(
        stage,
        world,
        None,
        2,
        LoopStats(),
        timeline=Timeline(0, 0, enabled=False),
        flight=FlightRecorder(0),
        liveness=liveness or _FakeLiveness(),
    )


def _abort(stopped: bool, **lost) -> Message:
    meta = {"op": "abort", "error": "KeyboardInterrupt: rank 1 interrupted", "stopped": stopped}
    return Message("control", 1, 0, 0, 0, [], {**meta, **lost})


def test_a_stopped_peers_abort_lets_this_ranks_own_signal_come_first():
    """The abort of a peer its launcher stopped waits the grace: this rank's own signal
    (the same launcher's), arriving meanwhile, is what it raises."""
    inbox = _inbox()

    def interrupted(signum, frame):
        raise KeyboardInterrupt("rank 0 interrupted")

    old = signal.signal(signal.SIGALRM, interrupted)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt, match="rank 0"):
            inbox.handle([_abort(stopped=True)], None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    start = time.monotonic()
    with pytest.raises(RemoteError, match="rank 1"):  # no signal came: the peer's error
        inbox.handle([_abort(stopped=True)], None)
    assert time.monotonic() - start >= STOP_GRACE_S
    start = time.monotonic()
    with pytest.raises(RemoteError, match="rank 1"):  # a failure of its own: at once
        inbox.handle([_abort(stopped=False)], None)
    assert time.monotonic() - start < STOP_GRACE_S


def test_the_flight_says_where_a_rank_is_between_steps_and_in_a_collective(tmp_path):
    failures = Failures(0, 2, tmp_path)
    failures.flight.now("running 0F1 (forward of microbatch 1) in evaluation step 1")
    failures.leave(3, 1)
    assert failures.flight.doing == "between steps, after 3 training steps and 1 evaluation"
    failures.transport = object()  # (peers: the collective is guarded)
    with failures.collective("a checkpoint save"):
        assert failures.flight.doing == "in a checkpoint save"
    assert failures.flight.doing == "between steps, after 3 training steps and 1 evaluation"
    failures.leave(4, 0)
    assert failures.flight.doing == "between steps, after 4 training steps"
    failures.leave(1, 2)
    assert failures.flight.doing == "between steps, after 1 training step and 2 evaluations"


def test_a_loss_is_news_at_once_and_one_found_in_the_grace_comes_first():
    """A stopped rank that relays a loss (lost=2) makes no one wait; a loss this rank finds
    while it waits out a stopped peer's grace is raised, not the peer's stop."""
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="rank 1 reports") as err:
        _inbox().handle([_abort(stopped=True, lost=2, doing="running 2F0")], None)
    assert err.value.rank == 2 and time.monotonic() - start < STOP_GRACE_S
    with pytest.raises(PeerLostError, match="lost rank 2") as err:
        _inbox(_FakeLiveness(lost_at=2)).handle([_abort(stopped=True)], None)
    assert err.value.rank == 2
