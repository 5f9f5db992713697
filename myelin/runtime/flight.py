"""The flight recorder: each rank's last few hundred messages and operations.

The loop notes what it receives, sends, runs and rejects, and what it is doing now; on
any error or deadline the trainer writes the record to the run directory and puts its
last lines in the error, so a failure says which (stage, microbatch, peer, action) never
came. Notes are tuples in a bounded deque: cheap enough to leave on.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

from myelin.atomic import write_atomic

__all__ = ["FlightRecorder", "default_dir"]


def default_dir() -> Path:
    """Where flight records go when no run directory is given: $MYELIN_RUN_DIR/flight, else
    ./myelin-flight."""
    run_dir = os.environ.get("MYELIN_RUN_DIR")
    return Path(run_dir) / "flight" if run_dir else Path.cwd() / "myelin-flight"


class FlightRecorder:
    """A ring buffer of (time, event) for one rank, and what the rank is doing now."""

    def __init__(self, rank: int, size: int = 512) -> None:
        self.rank = rank
        # (time, format, args): formatted only when read, as the loop notes every message
        self.events: deque[tuple[float, str, tuple]] = deque(maxlen=size)
        self.doing = "starting"  # read by the heartbeat thread: what peers see of this rank

    def note(self, event: str, *args: object) -> None:
        """Record an event: `event % args`, formatted only if the record is ever read."""
        self.events.append((time.time(), event, args))

    def _lines(self) -> list[tuple[float, str]]:
        return [(t, fmt % args if args else fmt) for t, fmt, args in list(self.events)]

    def now(self, doing: str) -> None:
        """Say what this rank is doing (sent to peers with each heartbeat)."""
        self.doing = doing

    def summary(self, last: int = 6) -> str:
        """The last events, oldest first, one per line."""
        events = self._lines()[-last:]  # a snapshot: other threads note too
        if not events:
            return "  (no events recorded)"
        end = events[-1][0]
        return "\n".join(f"  {t - end:+8.3f}s  {what}" for t, what in events)

    def dump(self, directory: str | os.PathLike, error: BaseException | str | None) -> Path:
        """Write the record as JSON to directory/rank{r}.json; returns the path."""
        path = Path(directory) / f"rank{self.rank}.json"
        record = {
            "rank": self.rank,
            "doing": self.doing,
            "error": None if error is None else f"{_name(error)}: {error}",
            "events": [{"time": t, "event": what} for t, what in self._lines()],
        }
        return write_atomic(path, json.dumps(record, indent=1))


def _name(error: BaseException | str) -> str:
    return type(error).__name__ if isinstance(error, BaseException) else "error"
