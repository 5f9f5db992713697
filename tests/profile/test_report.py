"""Idle accounting, summary, Chrome trace and PNG on timelines built without processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import zlib
from collections import defaultdict
from datetime import timedelta
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from myelin.errors import ConfigError, MyelinError
from myelin.profile.command import add_arguments, main
from myelin.profile.report import (
    ProfileConfig,
    ProfileReport,
    account,
    collect,
    finish_profile,
    gather,
    load,
    merge_intervals,
)
from myelin.profile.timeline import IDLE_CAUSES, Span, Timeline

F, B = 0.010, 0.020  # seconds of every forward and backward in the simulated pipelines


def gpipe(p: int, m: int, steps: int, opt: float = 0.001) -> list[Timeline]:
    """The timelines a GPipe pipeline of equal stages records, waits filling every gap."""
    lines = [Timeline(s, s) for s in range(p)]
    for line in lines:  # one clock, as if every rank started at the same instant
        line.wall_origin = lines[0].wall_origin
    free = [0.0] * p  # when each stage's previous step ended
    for step in range(steps):
        fwd = [[0.0] * m for _ in range(p)]
        for s in range(p):
            t = free[s]
            for i in range(m):
                start = max(t, fwd[s - 1][i] if s else t)
                _op(lines[s], "forward", f"{s}F{i}", t, start, start + F, step, i)
                t = fwd[s][i] = start + F
            free[s] = t
        bwd = [[0.0] * m for _ in range(p)]
        for s in reversed(range(p)):
            t = free[s]
            for i in range(m):
                start = max(t, bwd[s + 1][i] if s < p - 1 else t)
                _op(lines[s], "backward", f"{s}B{i}", t, start, start + B, step, i)
                t = bwd[s][i] = start + B
            lines[s].add("optimizer", f"{s}OPT", t, t + opt, step)
            free[s] = t + opt
    return lines


def _op(line: Timeline, kind: str, name: str, idle_from: float, start: float, end: float,
        step: int, mb: int) -> None:  # fmt: skip
    if start > idle_from:
        recv = name.replace("F", "RECV_F") if kind == "forward" else name.replace("B", "RECV_B")
        line.add("wait", recv, idle_from, start, step, cause="bubble", microbatch=mb)
    line.add(kind, name, start, end, step, microbatch=mb)


def with_sends(lines: list[Timeline]) -> list[Timeline]:
    """Add the sends each forward and backward makes (inside the op's end, 0.1 ms long)."""
    p = len(lines)
    for s, line in enumerate(lines):
        for span in list(line.spans):
            to = s + 1 if span.kind == "forward" else s - 1
            if span.kind in ("forward", "backward") and 0 <= to < p:
                op = "SEND_F" if span.kind == "forward" else "SEND_B"
                line.add("send", f"{s}{op}{span.microbatch}", span.end - 1e-4, span.end,
                         span.step, microbatch=span.microbatch, peer=to, track=f"peer {to}",
                         nbytes=4096)  # fmt: skip
    return lines


def report_of(lines: list[Timeline], warmup: int = 1) -> ProfileReport:
    return ProfileReport.from_ranks([collect(t) for t in lines], warmup_steps=warmup)


def check_trace(trace: dict) -> None:
    """The Trace Event Format's required fields, no overlap on a track, flows matched."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    json.loads(json.dumps(trace))  # plain JSON all the way down
    names = {}
    slices = defaultdict(list)
    flows = defaultdict(list)
    for e in events:
        assert e["ph"] in {"X", "M", "C", "s", "f"}, e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "M":
            assert e["name"] in {
                "process_name", "process_sort_index", "thread_name", "thread_sort_index"
            }, e  # fmt: skip
            assert isinstance(e["args"], dict) and isinstance(e["tid"], int)
            if e["name"] == "process_name":
                names[e["pid"]] = e["args"]["name"]
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0 and isinstance(e["cat"], str), e
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        else:
            assert isinstance(e["id"], int) and isinstance(e["tid"], int), e
            flows[e["id"]].append(e)
    for track, spans in slices.items():
        spans.sort()
        end, last = float("-inf"), ""
        for start, stop, name in spans:
            assert start >= end - 1e-6, f"{last} and {name} overlap on track {track}"
            end, last = max(end, stop), name
    for fid, pair in flows.items():
        assert sorted(e["ph"] for e in pair) == ["f", "s"], (fid, pair)
        s, f = sorted(pair, key=lambda e: e["ph"] != "s")
        assert s["ts"] <= f["ts"], (s, f)
        assert any(a <= s["ts"] <= b for a, b, _ in slices[(s["pid"], s["tid"])]), s
        assert any(a <= f["ts"] <= b for a, b, _ in slices[(f["pid"], f["tid"])]), f
    for pid in {k[0] for k in slices}:
        assert names[pid].startswith(f"rank {pid}"), names


# -- accounting ---------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (3, 1)])
def test_gpipe_bubble_is_exact_on_a_simulated_pipeline(p, m):
    summary = report_of(gpipe(p, m, steps=4)).summary()
    want = (p - 1) / (m + p - 1)
    assert summary["steady_steps"] == [1, 3]
    for row in summary["ranks"]:
        # the optimizer's 1 ms per step is busy time the formula does not know about
        assert row["idle"]["bubble"] == pytest.approx(want, abs=0.01), row
        assert row["busy_frac"] + sum(row["idle"].values()) == pytest.approx(1, abs=1e-9)
        assert row["idle"]["host_overhead"] == pytest.approx(0, abs=1e-9)
        assert row["whole_run"]["idle"]["bubble"] >= 0


def test_the_title_says_how_many_steps_were_evaluations():
    """The trainer numbers evaluation steps with training's: after 3 training steps and 2
    evaluations the report covers steps 1-4, and says 2 of them were evaluations."""
    lines = gpipe(2, 4, steps=3)
    end = max(s.end for line in lines for s in line.spans)
    for step in (3, 4):
        for line in lines:
            line.add("eval", f"{line.rank}F0", end, end + F, step, microbatch=0)
        end += F
    summary = report_of(lines).summary()
    assert summary["steady_steps"] == [1, 4] and summary["eval_steps"] == 2
    assert "over steps 1-4 (2 of them evaluation" in report_of(lines).format()
    assert report_of(gpipe(2, 4, steps=3)).summary()["eval_steps"] == 0


KIND_CAUSE = st.sampled_from(
    [("forward", None), ("backward", None), ("send", None), ("wait", "bubble"),
     ("allreduce", "collective_wait"), ("wait", "offload_wait"), ("gap", "other"),
     ("optimizer", "optimizer_host"), ("mystery", None), ("wait", "a_new_cause")]
)  # fmt: skip
SPANS = st.lists(
    st.tuples(KIND_CAUSE, st.integers(0, 40), st.integers(0, 10)).map(
        lambda t: Span(t[0][0], "x", "t", 0, t[1] / 4, (t[1] + t[2]) / 4, cause=t[0][1])
    ),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(spans=SPANS, lo=st.integers(0, 20), width=st.integers(0, 30), host=st.booleans())
def test_busy_and_idle_causes_always_add_up_to_the_wall_time(spans, lo, width, host):
    start, end = lo / 2, (lo + width) / 2
    got = account(spans, start, end, host_device=host)
    parts = [got["busy_frac"], *got["idle"].values()]
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(1.0 if width else 0.0, abs=1e-9)
    if got["overlap_frac"] is not None:
        assert 0 <= got["overlap_frac"] <= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 8)), max_size=20))
def test_merged_intervals_cover_the_same_grid_points(pairs):
    intervals = [(a, a + d) for a, d in pairs]
    merged = merge_intervals(intervals)
    assert all(a < b for a, b in merged)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(merged, merged[1:]))
    for x in [i / 2 + 0.25 for i in range(2 * 60)]:  # never on an end point
        inside = any(a < x < b for a, b in intervals)
        assert inside == any(a < x < b for a, b in merged), x


def test_idle_causes_partition_wall_time_and_busy_wins():
    spans = [
        Span("forward", "0F0", "compute", 0, 0.0, 1.0),
        Span("wait", "0WAIT", "wait", 0, 0.5, 2.0, cause="bubble"),  # half under compute
        Span("allreduce", "0ALLREDUCE", "collective", 0, 1.5, 3.0, cause="collective_wait"),
        Span("wait", "0WAIT", "wait", 0, 3.0, 3.5, cause="offload_wait"),
        Span("optimizer", "0OPT", "compute", 0, 3.5, 4.0, cause="optimizer_host"),
        Span("send", "0SEND_F0", "peer 1", 0, 0.8, 1.2, peer=1),
    ]
    got = account(spans, 0.0, 5.0)
    idle = got["idle"]
    assert list(idle) == list(IDLE_CAUSES)
    assert got["wall_s"] == 5.0 and got["busy_frac"] == pytest.approx(0.2)
    assert idle["bubble"] == pytest.approx(0.2)  # 1.0..2.0
    assert idle["collective_wait"] == pytest.approx(0.2)  # 2.0..3.0
    assert idle["offload_wait"] == pytest.approx(0.1)
    assert idle["optimizer_host"] == pytest.approx(0.1)  # a span with a cause is idle
    assert idle["host_overhead"] == pytest.approx(0.2)  # 4.0..5.0
    assert got["busy_frac"] + sum(idle.values()) == pytest.approx(1.0)
    assert got["overlap_frac"] == pytest.approx(0.5)  # 0.8..1.0 of 0.8..1.2


def test_a_backward_that_waits_for_its_pages_is_offload_wait_not_busy():
    """Within one microbatch backward waits for pages between layers, inside its own
    record: that time is the offload wait, not compute."""
    spans = [
        Span("backward", "0B0", "compute", 0, 0.0, 1.0, microbatch=0),
        Span("offload", "0FETCH0", "offload", 0, 0.2, 0.5, microbatch=0, cause="offload_wait"),
        Span("offload", "0FETCH0", "offload", 0, 0.9, 1.2, microbatch=0, cause="offload_wait"),
        Span("forward", "0F1", "compute", 0, 1.2, 2.0, microbatch=1),
    ]
    got = account(spans, 0.0, 2.0)
    assert got["busy_frac"] == pytest.approx(0.7)  # 0..0.2, 0.5..0.9, 1.2..2.0
    assert got["idle"]["offload_wait"] == pytest.approx(0.3)
    assert got["busy_frac"] + sum(got["idle"].values()) == pytest.approx(1.0)


def test_on_a_cpu_the_loop_thread_sending_is_not_compute():
    spans = [
        Span("forward", "0F0", "compute", 0, 0.0, 1.0, microbatch=0),
        Span("send", "0SEND_F0", "peer 1", 0, 0.8, 1.0, peer=1),  # inside the forward
        Span("wait", "0RECV_B0", "wait", 0, 1.0, 2.0, cause="bubble"),
    ]
    device = account(spans, 0.0, 2.0)  # device time: the send overlapped compute
    assert device["busy_frac"] == pytest.approx(0.5) and device["overlap_frac"] == 1.0
    host = account(spans, 0.0, 2.0, host_device=True)
    assert host["busy_frac"] == pytest.approx(0.4) and host["overlap_frac"] == 0.0
    assert host["idle"]["host_overhead"] == pytest.approx(0.1)
    assert host["exposed_send_frac"] == pytest.approx(0.1)


def test_no_records_no_division_by_zero():
    report = ProfileReport.from_ranks([collect(Timeline(0, 0))])
    row = report.summary()["ranks"][0]
    assert row["wall_s"] == 0 and row["busy_frac"] == 0 and row["overlap_frac"] is None
    assert "rank" in report.format()


def test_duplicate_ranks_and_bad_warmup_are_refused():
    rec = collect(Timeline(0, 0))
    with pytest.raises(MyelinError, match="each rank once"):
        ProfileReport.from_ranks([rec, rec])
    with pytest.raises(ConfigError, match="warmup_steps"):
        ProfileReport.from_ranks([rec], warmup_steps=-1)


def test_summary_shape_and_table():
    report = report_of(with_sends(gpipe(2, 4, steps=3)))
    summary = report.summary()
    assert summary["format"] == "myelin-profile-summary" and summary["world_size"] == 2
    for row in summary["ranks"]:
        assert {"rank", "stage", "wall_s", "busy_frac", "idle", "overlap_frac"} <= set(row)
        assert set(row["idle"]) == set(IDLE_CAUSES)
        assert row["whole_run"]["wall_s"] > row["wall_s"]
    text = report.format()
    assert "bubble" in text and "mean" in text and "steps 1-2" in text
    assert text.count("\n") == 5  # title, header, rule, two ranks, mean


# -- files ------------------------------------------------------------------------------------


def test_chrome_trace_is_valid_with_flows_and_counters():
    lines = with_sends(gpipe(3, 4, steps=2))
    lines[1].wall_origin += 0.25  # rank 1 started its clock later: its times are smaller
    for span in lines[1].spans:
        span.start, span.end = span.start - 0.25, span.end - 0.25
    records = [collect(t) for t in lines]
    records[0]["counters"] = {"host rss MiB": [[0.0, 100.0], [0.1, 101.5]]}
    report = ProfileReport.from_ranks(records)
    trace = report.trace()
    check_trace(trace)
    events = trace["traceEvents"]
    procs = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {"rank 0 (stage 0)", "rank 1 (stage 1)", "rank 2 (stage 2)"}
    flows = [e for e in events if e["ph"] == "s"]
    assert len(flows) == 2 * 2 * 4 * 2  # (p-1) links x F and B x m microbatches x steps
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"1F3", "1B3", "0SEND_F3", "1SEND_B0", "1RECV_F0"} <= names
    assert [e for e in events if e["ph"] == "C"][0]["args"] == {"MiB": 100.0}
    f0 = {e["pid"]: e["ts"] for e in events if e["name"] in ("0F0", "1F0") and e["ph"] == "X"}
    assert f0[1] == pytest.approx(f0[0] + F * 1e6)  # one clock again: flows point forward


def test_overlapping_spans_of_a_track_get_separate_lanes():
    line = Timeline(0, 0)
    line.add("forward", "0F0", 0.0, 1.0, 0, microbatch=0, track="stream 7")
    line.add("forward", "0F1", 0.5, 1.5, 0, microbatch=1, track="stream 7")
    trace = ProfileReport.from_ranks([collect(line)]).trace()
    check_trace(trace)
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"stream 7", "stream 7 (2)"}


def test_save_load_and_the_picture(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    report = report_of(with_sends(gpipe(4, 8, steps=3)))
    paths = report.save(tmp_path / "prof")
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [
        "ranks", "summary.json", "timeline.png", "trace.json"
    ]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "prof" / "ranks").iterdir()) == [
        f"rank{r}.json" for r in range(4)
    ]
    check_trace(json.loads(paths["trace"].read_text()))
    image = Image.open(paths["timeline"]).convert("RGB")
    assert image.size == (1200, 390)  # 12 x (1.9 + 0.5 per rank) inches at 100 dpi
    assert len(image.getcolors(1 << 20)) > 50  # bars, labels and legend, antialiased
    again = load(tmp_path / "prof")
    assert again.summary() == json.loads(paths["summary"].read_text())


def test_a_directory_reused_by_fewer_ranks_holds_only_this_runs(tmp_path):
    report_of(with_sends(gpipe(3, 4, steps=2))).save(tmp_path / "prof", plot=False)
    report_of(with_sends(gpipe(2, 4, steps=2))).save(tmp_path / "prof", plot=False)
    names = sorted(p.name for p in (tmp_path / "prof" / "ranks").iterdir())
    assert names == ["rank0.json", "rank1.json"]
    assert [r["rank"] for r in load(tmp_path / "prof").summary()["ranks"]] == [0, 1]


def test_picture_for_sixteen_ranks(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = report_of(gpipe(16, 16, steps=2)).plot(tmp_path / "t.png")
    assert Image.open(path).size == (1200, 990)


def test_a_warm_up_as_long_as_the_run_is_said_to_be_left_in():
    """--warmup-steps past the run's steps leaves none out; the title says so."""
    lines = gpipe(2, 4, steps=3)
    assert "over steps 1-2 (after 1 warm-up)" in report_of(lines).format()
    text = report_of(lines, warmup=5).format()
    assert "over steps 0-2 (every step: the run has no more than the 5 warm-up" in text
    assert "warm-up" not in report_of(lines, warmup=0).format()


def test_myelin_profile_command_prints_and_redraws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report_of(with_sends(gpipe(2, 4, steps=3))).save(tmp_path / "prof", plot=False)
    parser = add_arguments(argparse.ArgumentParser())
    assert main(parser.parse_args([str(tmp_path / "prof"), "--steps", "2"])) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and out.count("\n") >= 5
    assert (tmp_path / "prof" / "timeline.png").stat().st_size > 10_000
    assert main(parser.parse_args([str(tmp_path / "prof"), "--json", "--no-plot"])) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][1]["stage"] == 1
    assert main(parser.parse_args([str(tmp_path / "prof"), "--out", str(tmp_path / "b")])) == 0
    assert (tmp_path / "b" / "trace.json").exists() and (tmp_path / "b" / "timeline.png").exists()
    assert main(parser.parse_args([str(tmp_path / "nothing")])) == 2
    assert "does not exist" in capsys.readouterr().err
    # a `myelin train` run directory (config.json, metrics.jsonl, profile/): its profile
    run = tmp_path / "run"
    report_of(gpipe(2, 4, steps=3)).save(run / "profile", plot=False)
    (run / "config.json").write_text("{}")
    assert main(parser.parse_args([str(run), "--no-plot"])) == 0
    assert "bubble" in capsys.readouterr().out


def test_without_matplotlib_the_numbers_are_still_written(tmp_path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    paths = report_of(gpipe(2, 2, steps=2)).save(tmp_path)
    assert "timeline" not in paths and paths["summary"].exists()
    assert "pip install matplotlib" in caplog.text


@pytest.mark.skipif(shutil.which("trace_processor_shell") is None, reason="no trace_processor")
def test_perfetto_loads_the_trace(tmp_path):
    """Perfetto's own importer (pip perfetto + a trace_processor_shell on PATH)."""
    tp_mod = pytest.importorskip("perfetto.trace_processor")
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(report_of(with_sends(gpipe(2, 4, steps=2))).trace()))
    config = tp_mod.TraceProcessorConfig(bin_path=shutil.which("trace_processor_shell"))
    with tp_mod.TraceProcessor(trace=str(path), config=config) as tp:
        slices = next(iter(tp.query("select count(*) as n from slice"))).n
        bad = "select name, value from stats where severity = 'error' and value > 0"
        errors = list(tp.query(bad))
        flows = next(iter(tp.query("select count(*) as n from flow"))).n
    assert slices > 0 and flows > 0 and not errors, errors


# -- settings and gathering ------------------------------------------------------------------


def test_profile_config_from_trainer_argument(tmp_path):
    assert ProfileConfig.from_arg(False) is None and ProfileConfig.from_arg(None) is None
    assert ProfileConfig.from_arg(True) == ProfileConfig()
    assert ProfileConfig.from_arg(tmp_path).out_dir == str(tmp_path)
    cfg = ProfileConfig(out_dir="x", interval_s=0.5)
    assert ProfileConfig.from_arg(cfg) is cfg
    for bad, match in [
        ({"interval_s": 0}, "interval_s=0"),
        ({"interval_s": True}, "interval_s=True"),
        ({"warmup_steps": -1}, "warmup_steps=-1"),
        ({"gather_timeout_s": 1e9}, "gather_timeout_s"),
        ({"out_dir": 3}, "out_dir=3"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ProfileConfig(**bad)
    with pytest.raises(ConfigError, match="profile=3"):
        ProfileConfig.from_arg(3)


class FakeStore:
    """The parts of a torch.distributed store that gather uses, in one process."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, n: int) -> int:
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])

    def set(self, key: str, value: bytes) -> None:
        assert isinstance(value, bytes)  # JSON bytes, never a pickled object
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if not self.check(keys):
            raise RuntimeError("Socket Timeout")  # what DistStoreError is

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


def world(rank: int, size: int, store: FakeStore) -> SimpleNamespace:
    layout = SimpleNamespace(world_size=size)
    return SimpleNamespace(rank=rank, layout=layout, store=store, replica=0, device="cpu")


def test_gather_through_the_store_and_clean_up():
    store = FakeStore()
    lines = gpipe(3, 2, steps=1)
    records = [collect(t) for t in lines]
    for r in (1, 2):  # ranks 1 and 2 publish first; rank 0 then finds everything
        store.set(f"myelin/profile/1/{r}", zlib.compress(json.dumps(records[r]).encode()))
        store.add(f"myelin/profile/calls/{r}", 1)
    got, missing = gather(records[0], world(0, 3, store))
    assert missing == [] and [g["rank"] for g in got] == [0, 1, 2]
    assert got[1] == json.loads(json.dumps(records[1]))
    store.add("myelin/profile/1/read", 2)  # as if ranks 1 and 2 had read too
    _, _ = gather(records[0], world(0, 3, store))  # a second call uses fresh keys
    assert "myelin/profile/2/0" in store.data


def test_gather_names_ranks_that_never_sent(caplog):
    store = FakeStore()
    got, missing = gather(collect(Timeline(0, 0)), world(0, 3, store), timeout_s=0.1)
    assert missing == [1, 2] and len(got) == 1
    assert "no profile records from ranks [1, 2]" in caplog.text


def test_finish_profile_prints_and_saves_on_rank_zero(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    line = gpipe(1, 4, steps=3)[0]
    sampler = SimpleNamespace(stop=lambda: None, counters={"host rss MiB": [[0.0, 1.0]]})
    cfg = ProfileConfig(out_dir=str(tmp_path / "p"))
    report = finish_profile(line, world(0, 1, None), sampler, cfg)
    assert report is not None and "rank" in capsys.readouterr().out
    assert (tmp_path / "p" / "summary.json").exists()
    assert (tmp_path / "p" / "timeline.png").exists()


def test_finish_profile_after_a_failure_keeps_this_ranks_records_only(tmp_path):
    line = gpipe(2, 2, steps=1)[1]
    cfg = ProfileConfig(out_dir=str(tmp_path))
    report = finish_profile(line, world(1, 2, FakeStore()), None, cfg, failed=True)
    assert [r["rank"] for r in report.ranks] == [1]
    assert (tmp_path / "ranks" / "rank1.json").exists()
    assert not (tmp_path / "summary.json").exists()


def test_a_failed_run_in_a_reused_directory_leaves_nothing_of_the_earlier_run(tmp_path):
    """An earlier 4-rank run's summary, trace and ranks 2-3 would be read back as this
    2-rank run's; rank 0's own failure path clears them (rank 1 writes its own record)."""
    (tmp_path / "ranks").mkdir()
    for name in ("summary.json", "trace.json", *(f"ranks/rank{r}.json" for r in range(4))):
        (tmp_path / name).write_text("{}")
    cfg = ProfileConfig(out_dir=str(tmp_path))
    finish_profile(gpipe(2, 2, steps=1)[0], world(0, 2, FakeStore()), None, cfg, failed=True)
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == ["rank0.json", "rank1.json"]
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "trace.json").exists()


def test_a_report_gathered_is_kept_when_its_files_cannot_be_written(tmp_path, caplog):
    cfg = ProfileConfig(out_dir=str(tmp_path / "p"))
    (tmp_path / "p").write_text("a file where the directory should be")
    line = gpipe(1, 4, steps=3)[0]
    report = finish_profile(
        line, world(0, 1, None), None, dataclasses.replace(cfg, print_summary=False)
    )
    assert report is not None and "could not write the profile" in caplog.text


def test_a_profile_directory_that_cannot_be_made_is_named_when_the_trainer_is_built(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="profile out_dir=.*afile/p.* cannot be made"):
        ProfileConfig.from_arg(str(tmp_path / "afile" / "p"))


def test_finish_profile_never_raises(caplog):
    broken = SimpleNamespace(rank=0)  # no layout, no store: gathering fails
    assert finish_profile(Timeline(0, 0), broken) is None
    assert "could not finish the profile" in caplog.text


def test_a_peers_failure_in_the_gather_is_one_line_not_a_traceback(caplog, monkeypatch):
    from myelin.errors import RemoteError
    from myelin.profile import report as report_module

    def peer_failed(*args, **kwargs):
        raise RemoteError(1, "KeyboardInterrupt: rank 1 interrupted")

    monkeypatch.setattr(report_module, "gather_report", peer_failed)
    assert finish_profile(Timeline(0, 0), SimpleNamespace(rank=0)) is None
    (record,) = [r for r in caplog.records if "could not finish the profile" in r.message]
    assert "rank 1 failed" in record.message and not record.exc_info
