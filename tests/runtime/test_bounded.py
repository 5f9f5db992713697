"""Bounded waits (runtime/bounded.py) on a torch.distributed Work, without processes."""

from __future__ import annotations

import pytest

from myelin.runtime.bounded import Waits


class _Work:
    """A Work that completes `late` looks after its slice's wait timed out (gloo's race:
    the slice's wait gives up, then the collective finishes before the next look)."""

    def __init__(self, late: int, error: Exception | None = None) -> None:
        self.looks, self.late, self.error = 0, late, error

    def is_completed(self) -> bool:
        self.looks += 1
        return self.looks > self.late

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            raise RuntimeError("Operation timed out!")  # what c10d's Work::wait raises
        if self.error is not None:
            raise self.error
        return True


def test_a_collective_that_finishes_as_its_slice_times_out_is_done_not_failed():
    Waits(None, "rank 0", 5.0).work(_Work(late=1))  # raised "Operation timed out!" before


def test_a_collective_still_running_is_waited_for_slice_by_slice():
    work = _Work(late=5)
    Waits(None, "rank 0", 5.0).work(work)
    assert work.looks > 5


def test_a_collective_that_failed_raises_its_own_error():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        Waits(None, "rank 0", 5.0).work(
            _Work(late=1, error=RuntimeError("Connection closed by peer"))
        )
