"""Every file myelin writes survives all ranks (and threads) writing it at once.

SPMD scripts run the same lines on every rank, so a report saved "once" is saved by every
rank into one directory, and a rank's heartbeat thread may write its flight record while
its main thread does. Each writer must end with a whole file and nothing half-written or
temporary left behind. Before: `ProfileReport.save` and `FlightRecorder.dump` used one
temporary name per target, so a second writer's rename found it gone
(FileNotFoundError), and the PNG was written in place.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

import pytest

from myelin.profile.report import ProfileReport, collect
from myelin.profile.timeline import Timeline
from myelin.runtime.flight import FlightRecorder

WRITERS, ROUNDS = 4, 8


def _report() -> ProfileReport:
    records = []
    for rank in (0, 1):
        t = Timeline(rank, rank)
        for step in range(3):
            base = step * 0.1 + rank * 0.01
            t.add("forward", f"{rank}F0", base, base + 0.02, step, microbatch=0)
            t.add("wait", f"{rank}WAIT", base + 0.02, base + 0.05, step, cause="bubble")
            t.add("backward", f"{rank}B0", base + 0.05, base + 0.09, step, microbatch=0)
        records.append(collect(t, replica=0))
    return ProfileReport.from_ranks(records)


def _write_all(out: str, plot: bool, errors) -> None:
    """One writer: the report and a flight record, from two threads at once, many times."""
    report = _report()
    flight = FlightRecorder(rank=0)
    flight.note("an event")

    def save() -> None:
        for _ in range(ROUNDS):
            report.save(out, plot=plot)

    def dump() -> None:
        for _ in range(ROUNDS):
            flight.dump(Path(out) / "flight", "an error")

    threads = [threading.Thread(target=f) for f in (save, dump, dump)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        save()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize(
    "plot",
    [False, pytest.param(True, id="with-png", marks=pytest.mark.slow)],  # png: 6 s
)
def test_writers_in_many_processes_and_threads_leave_whole_files(tmp_path, plot):
    if plot:
        pytest.importorskip("matplotlib")
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_write_all, args=(str(tmp_path), plot, errors)) for _ in range(WRITERS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, failures[:3]
    assert all(p.exitcode == 0 for p in procs)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    expected = ["flight/rank0.json", "ranks/rank0.json", "ranks/rank1.json", "summary.json"]
    expected += ["timeline.png"] * plot + ["trace.json"]
    assert files == sorted(expected)  # and no temporary file left behind
    for name in ("summary.json", "trace.json", "ranks/rank0.json", "flight/rank0.json"):
        json.loads((tmp_path / name).read_text())
    if plot:
        assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
