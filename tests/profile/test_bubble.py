"""The bubble a report shows is the one the schedule implies; other waits have causes of
their own. One real 2-stage job (tests/workers/bubble.py, issue 11's reproduction: 6 x
Linear(384, 384)+tanh per stage, 4 microbatches, GPipe, 12 steps) also checks two other
things the same run shows: every rank saving the report to one directory (item 1) and
the shared memory each rank holds (item 7).

Before: bubble 0.25-0.29 per rank against (p-1)/(m+p-1) = 0.20, no expected figure; the
SPMD save crashed with FileNotFoundError; each rank held 512 MiB of shared memory.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

import pytest

from myelin.profile.command import add_arguments, main
from tests._procs import launch

TOL = 0.03  # the 3 points, between the bubble seen and the bubble expected
MICROBATCHES = 4
IDEAL = (2 - 1) / (MICROBATCHES + 2 - 1)  # (p-1)/(m+p-1)
FORMULA_TOL = 0.05  # the replay's expected bubble against the closed form (_gpipe_bubble)
WAIT_CAUSES = {"bubble", "latency", "slow_peer", "sync"}


def _run(tmp):
    job = launch(2, "bubble.py", [], tmp, timeout=180)
    assert job.returncode == 0, job.output[-5000:]
    job.dir = tmp / "out"
    job.summary = json.loads((job.dir / "prof" / "summary.json").read_text())
    return job


def _gpipe_bubble(prof, summary) -> list[float]:
    """Each rank's bubble that 2-stage GPipe implies for the mean op times measured:
    forwards then backwards flow through both stages, the slower stage of each phase
    setting the pace, one step every f0+f1+b0+b1+(m-1)(max f+max b)+opt0 (rank 0's
    optimizer step, then its first forward, is on the critical path); with f and b equal on
    both stages this is (p-1)/(m+p-1). A rank's own time between operations (sends,
    bookkeeping) is left out: the replay keeps it, but most of it falls where the rank would
    wait anyway (measured: the two agree within 2 points, idle or loaded)."""
    first, last = summary["steady_steps"]
    steps = last - first + 1
    per = {}
    for row in summary["ranks"]:
        record = json.loads((prof / "ranks" / f"rank{row['rank']}.json").read_text())
        total, count = defaultdict(float), Counter()
        for values in record["spans"]:
            span = dict(zip(record["span_fields"], values))
            if span["step"] >= first and span["kind"] in ("forward", "backward", "optimizer"):
                total[span["kind"]] += span["end"] - span["start"]
                count[span["kind"]] += 1
        per[row["stage"]] = {
            "f": total["forward"] / count["forward"],
            "b": total["backward"] / count["backward"],
            "opt": total["optimizer"] / steps,
            "busy": sum(total.values()) / steps,
        }
    (f0, b0), (f1, b1) = ((per[s]["f"], per[s]["b"]) for s in (0, 1))
    period = f0 + f1 + b0 + b1 + (MICROBATCHES - 1) * (max(f0, f1) + max(b0, b1)) + per[0]["opt"]
    return [1 - per[row["stage"]]["busy"] / period for row in summary["ranks"]]


def _misses(job) -> bool:
    """Whether a burst of load skewed this run: the bubble seen off the expected one, or
    the replay's expected bubble off the closed form for the op times measured."""
    rows = job.summary["ranks"]
    if any(abs(r["idle"]["bubble"] - r["expected_bubble"]) > TOL for r in rows):
        return True
    formula = _gpipe_bubble(job.dir / "prof", job.summary)
    mean_expected = sum(r["expected_bubble"] for r in rows) / len(rows)
    return abs(mean_expected - sum(formula) / len(formula)) > FORMULA_TOL


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job; measured again (twice at most) if load skewed it (the machine is shared,
    and a burst of load can stall one rank in the middle of a step)."""
    job = _run(tmp_path_factory.mktemp("bubble"))
    for again in range(2):
        if not _misses(job):
            break
        job = _run(tmp_path_factory.mktemp(f"bubble-again{again}"))
    return job


def test_equal_stages_match_the_bubble_the_schedule_implies(job, capsys):
    summary = job.summary
    rows = summary["ranks"]
    for row in rows:
        assert WAIT_CAUSES <= row["idle"].keys(), row["idle"]
        assert row["busy_frac"] + sum(row["idle"].values()) == pytest.approx(1, abs=0.01)
        expected, seen = row["expected_bubble"], row["idle"]["bubble"]
        assert seen == pytest.approx(expected, abs=TOL), (row["rank"], seen, expected, row)
    # the replay implies what the GPipe formula gives for the stage times measured: the
    # textbook (p-1)/(m+p-1) when they are equal, more when a stage is slower in one phase
    # (the last stage's forward carries the loss; on a loaded machine one rank's process is
    # slowed by others' jobs), even with equal busy totals
    mean_expected = sum(r["expected_bubble"] for r in rows) / len(rows)
    formula = _gpipe_bubble(job.dir / "prof", summary)
    assert mean_expected == pytest.approx(sum(formula) / len(formula), abs=FORMULA_TOL), (
        formula,
        rows,
    )
    assert min(formula) > 0 and sum(formula) / len(formula) >= IDEAL - 0.02, formula
    assert summary["mean"]["expected_bubble"] == pytest.approx(mean_expected)
    # messages take time to arrive: that waiting is latency, not bubble
    assert sum(r["idle"]["latency"] for r in rows) > 0, rows
    # `myelin profile` prints the expected bubble beside the observed one
    args = add_arguments(argparse.ArgumentParser()).parse_args([str(job.dir / "prof"), "--no-plot"])
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "expected" in table and "latency" in table, table


def test_every_rank_saves_the_report_to_one_directory(job):
    """SPMD: both ranks ran `trainer.profile_report().save(dir)` three times, at once."""
    assert all(job.results[r]["saved_every"] for r in (0, 1))
    every = job.dir / "every"
    names = sorted(p.name for p in every.rglob("*") if p.is_file())
    assert names == ["rank0.json", "rank1.json", "summary.json", "timeline.png", "trace.json"]
    for name in ("summary.json", "trace.json"):
        json.loads((every / name).read_text())
    assert (every / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_memory_is_committed_as_it_is_used(job):
    """Each 2-rank pair used to commit 256 MiB per direction at its first large send
    (512 MiB resident per rank); the activations here are 96 KiB."""
    for rank in (0, 1):
        res = job.results[rank]
        assert res["rss_shmem_kib"] < 64 * 1024, res
        memory = res["memory"]
        assert memory["rss_bytes"] == pytest.approx(res["vm_rss_kib"] * 1024, rel=0.25)
        assert memory["rss_peak_bytes"] >= memory["rss_bytes"] > 0
        assert 0 < memory["shm_committed_bytes"] < 16 * 2**20, memory
