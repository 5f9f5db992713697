"""Real pipelines, profiled: GPipe's measured bubble is (p-1)/(m+p-1), and the files are sound.

Fixed-time stages (sleeps: 20 ms forward, 40 ms backward) give the same figure however
many cores the ranks share: every rank within 5 points. Real compute on two stages of a
2-core machine is noisier: each operation's time jitters by several percent, and under
GPipe the faster stage waits for the slower one at every handoff, which is real idle
time the profiler sees; the figure lands a few points above the formula. The slow suite
checks it within 5 points, as the median of three runs (test_bubble.py checks real
compute in the default suite, against the bubble the measured op times imply).
A timing figure that misses is measured once more before the test fails: the machine is
shared, and a burst of load delays wake-ups.
"""

from __future__ import annotations

import argparse
import json

import pytest

from myelin.profile.command import add_arguments, main
from tests._procs import Job, launch
from tests.profile.test_report import check_trace

TOL = 0.05  # the 5 percentage points
REAL_TOL = 0.10  # real compute measured once (measure()); the slow test holds it to TOL
FIXED_TWO = ["fixed:2:4:gpipe", "fixed:2:8:gpipe"]
REAL_TWO = ["mlp:2:4:gpipe", "mlp:2:8:gpipe"]


def ideal(case: str) -> float:
    _, p, m, _ = case.split(":")
    return (int(p) - 1) / (int(m) + int(p) - 1)


def rows(job, case: str) -> list[dict]:
    return [job.results[r][case]["figures"] for r in sorted(job.results)]


def bubbles(job, case: str) -> list[float]:
    """Each rank's bubble for fixed-time stages; the mean over ranks for real compute."""
    got = [r["idle"]["bubble"] for r in rows(job, case)]
    return got if case.startswith("fixed") else [sum(got) / len(got)]


def tolerance(case: str) -> float:
    return TOL if case.startswith("fixed") else REAL_TOL


def misses(job, cases: list[str]) -> list[str]:
    return [c for c in cases if any(abs(b - ideal(c)) > tolerance(c) for b in bubbles(job, c))]


def measure(nproc: int, cases: list[str], save: str, tmp_path):
    """Run the cases; re-measure, once, those whose bubble misses the formula."""
    job = launch(nproc, "profiled.py", ["--save", save, *cases], tmp_path, timeout=240)
    assert job.returncode == 0, job.output[-5000:]
    assert sorted(job.results) == list(range(nproc)), job.output[-3000:]
    timing = [c for c in cases if c.startswith(("fixed", "mlp"))]
    if again := misses(job, timing):
        (tmp_path / "again").mkdir()
        job2 = launch(
            nproc, "profiled.py", ["--save", save, *again], tmp_path / "again", timeout=180
        )
        assert job2.returncode == 0, job2.output[-5000:]
        for rank, got in job2.results.items():
            job.results[rank].update(got)
    for case in timing:
        for row in rows(job, case):
            assert row["busy_frac"] + sum(row["idle"].values()) == pytest.approx(1, abs=0.01)
            whole = row["whole_run"]
            assert whole["busy_frac"] + sum(whole["idle"].values()) == pytest.approx(1, abs=0.01)
        for bubble in bubbles(job, case):
            assert bubble == pytest.approx(ideal(case), abs=tolerance(case)), rows(job, case)
    return job


def test_a_missed_figure_is_measured_once_more(tmp_path, monkeypatch):
    def result(bubble, saved):
        idle = {"bubble": bubble, "host_overhead": 0.8 - bubble}
        row = {"busy_frac": 0.2, "idle": idle, "whole_run": {"busy_frac": 0.2, "idle": idle}}
        return {"fixed:2:4:gpipe": {"figures": row, "saved": saved}}

    calls = []

    def fake_launch(nproc, worker, args, tmp, timeout):
        calls.append(args)
        bubble = 0.4 if len(calls) == 1 else 0.21  # the first measurement misses 0.2
        return Job(0, "", {r: result(bubble, f"{tmp}/saved") for r in range(nproc)})

    monkeypatch.setitem(measure.__globals__, "launch", fake_launch)
    job = measure(2, ["fixed:2:4:gpipe"], "fixed:2:4:gpipe", tmp_path)
    assert calls == [["--save", "fixed:2:4:gpipe", "fixed:2:4:gpipe"]] * 2
    assert bubbles(job, "fixed:2:4:gpipe") == [0.21, 0.21]
    assert job.results[0]["fixed:2:4:gpipe"]["saved"] == f"{tmp_path / 'again'}/saved"


def check_files(job, case: str, ranks: int) -> None:
    """trace.json valid, summary.json shaped, timeline.png a real picture."""
    from PIL import Image

    saved = job.results[0][case]["saved"]
    summary = json.loads(open(f"{saved}/summary.json").read())
    assert [r["rank"] for r in summary["ranks"]] == list(range(ranks))
    assert summary["ranks"][0]["idle"].keys() == {
        "bubble", "latency", "slow_peer", "sync", "offload_wait", "collective_wait",
        "optimizer_host", "host_overhead"
    }  # fmt: skip
    trace = json.loads(open(f"{saved}/trace.json").read())
    check_trace(trace)
    assert sum(e["ph"] == "s" for e in trace["traceEvents"]) > 0
    assert any(e["ph"] == "C" for e in trace["traceEvents"])  # sampled memory
    image = Image.open(f"{saved}/timeline.png").convert("RGB")
    assert image.size == (1200, int(100 * (1.9 + 0.5 * ranks)))
    assert len(image.getcolors(1 << 20)) > 50


def test_two_fixed_stages_and_a_torch_trace(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    job = measure(2, [*FIXED_TWO, "torch"], FIXED_TWO[0], tmp_path)
    check_files(job, FIXED_TWO[0], 2)
    # `myelin profile` on the traces torch.profiler wrote, one file per rank
    traces = tmp_path / "out" / "torch_traces"
    assert main(add_arguments(argparse.ArgumentParser()).parse_args([str(traces), "--json"])) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for row in summary["ranks"]:
        assert row["busy_frac"] > 0 and row["idle"]["collective_wait"] > 0
        assert row["busy_frac"] + sum(row["idle"].values()) == pytest.approx(1, abs=0.01)


@pytest.mark.slow  # 10 s; the two-stage cases and test_bubble.py cover the accounting
def test_four_fixed_stages(tmp_path):
    pytest.importorskip("matplotlib")
    case = "fixed:4:8:gpipe"
    check_files(measure(4, [case], case, tmp_path), case, 4)


@pytest.mark.slow
def test_real_compute_bubble_within_five_points(tmp_path):
    """Two stages of real compute: the median of three runs' mean bubble, within 5 points."""
    got: dict[str, list[float]] = {case: [] for case in REAL_TWO}
    for run in range(3):
        (tmp_path / str(run)).mkdir()
        job = launch(2, "profiled.py", REAL_TWO, tmp_path / str(run), timeout=180)
        assert job.returncode == 0, job.output[-5000:]
        for case in REAL_TWO:
            got[case] += bubbles(job, case)
    for case, values in got.items():
        assert sorted(values)[1] == pytest.approx(ideal(case), abs=TOL), (case, values)
