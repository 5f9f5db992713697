"""torch.profiler traces: GPU idle split as HTA splits it; a real CPU trace end to end."""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from myelin.errors import MyelinError
from myelin.profile.command import add_arguments, main
from myelin.profile.report import ProfileReport
from myelin.profile.torch_trace import load_traces, to_record


def kernel(name, ts, dur, stream, corr, cat="kernel"):
    args = {"device": 0, "stream": stream, "correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9,
            "ts": ts, "dur": 0.5, "args": {"correlation": corr}}  # fmt: skip


def annotation(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 9, "tid": 9, "ts": ts,
            "dur": dur}  # fmt: skip


def cuda_trace(extra=()):
    """Microseconds: A 0-10, B 12-20 (launched late), C 20.01-30, D 40-50; NCCL 45-60."""
    events = [
        kernel("gemm_A", 0, 10, 7, 1), launch(-5, 1),
        kernel("gemm_B", 12, 8, 7, 2), launch(11, 2),  # launched after A ended: host wait
        kernel("gemm_C", 20.01, 9.99, 7, 3), launch(5, 3),  # 10 ns after B: short gap
        kernel("gemm_D", 40, 10, 7, 4), launch(6, 4),  # 10 us after C, queued: other
        kernel("ncclDevKernel_AllReduce_Sum_f32", 45, 15, 9, 5), launch(7, 5),
        kernel("Memcpy DtoH", 62, 2, 7, 6, cat="gpu_memcpy"), launch(61, 6),  # host wait
        annotation("ProfilerStep#5", -10, 45), annotation("ProfilerStep#6", 35, 35),
        *extra,
    ]  # fmt: skip
    info = {"backend": "nccl", "rank": 3, "world_size": 4}
    return {"traceEvents": events, "distributedInfo": info, "baseTimeNanoseconds": 10**18}


def figures(trace, **kw):
    rec = to_record(trace, rank=trace["distributedInfo"]["rank"], **kw)
    return rec, ProfileReport.from_ranks([rec], warmup_steps=0).summary()["ranks"][0]


def test_cuda_trace_idle_split_as_hta_defines_it():
    rec, row = figures(cuda_trace())
    assert rec["rank"] == 3 and rec["device"] == "cuda:0" and rec["source"] == "torch.profiler"
    assert rec["wall_origin"] == pytest.approx(1e9 - 10e-6)
    wall = 64e-6
    assert row["wall_s"] == pytest.approx(wall)
    idle = row["idle"]
    assert row["busy_frac"] == pytest.approx((10 + 8 + 9.99 + 10 + 2) / 64)
    assert idle["host_wait"] == pytest.approx((2 + 2) / 64)
    assert idle["short_gap"] == pytest.approx(0.01 / 64)
    assert idle["other"] == pytest.approx(10 / 64)
    assert idle["collective_wait"] == pytest.approx(10 / 64)  # NCCL 50-60 with no compute
    assert idle["bubble"] == 0 and idle["host_overhead"] == pytest.approx(0, abs=1e-9)
    assert row["busy_frac"] + sum(idle.values()) == pytest.approx(1.0)
    assert row["overlap_frac"] == pytest.approx(5 / 15)  # HTA's comm/compute overlap
    streams = row["detail"]["streams"]  # HTA's per-stream breakdown, in seconds
    assert streams["stream 7"] == pytest.approx(
        {"host_wait": 14e-6, "short_gap": 0.01e-6, "other": 10e-6}
    )
    assert streams["stream 9"] == {"host_wait": 0.0, "short_gap": 0.0, "other": 0.0}
    steps = {s[1]: s[3] for s in rec["spans"]}  # kernel name -> step that launched it
    assert steps["gemm_B"] == 5 and steps["Memcpy DtoH"] == 6


def test_myelin_ranges_in_a_torch_trace_turn_idle_into_a_bubble():
    _, row = figures(cuda_trace([annotation("1WAIT", 30, 10), annotation("1F3", 0, 10)]))
    assert row["idle"]["bubble"] == pytest.approx(10 / 64)  # was "other" without it
    assert row["idle"]["other"] == pytest.approx(0, abs=1e-12)
    assert row["stage"] == 1


def test_short_gap_threshold_is_adjustable():
    _, row = figures(cuda_trace(), short_gap_us=20)
    assert row["idle"]["short_gap"] == pytest.approx((0.01 + 10) / 64)
    assert row["idle"]["other"] == pytest.approx(0, abs=1e-12)


def test_files_ranks_and_errors(tmp_path):
    big, small = cuda_trace(), cuda_trace()
    small["traceEvents"] = small["traceEvents"][:4]
    with gzip.open(tmp_path / "a.pt.trace.json.gz", "wt") as f:
        json.dump(big, f)
    (tmp_path / "b.pt.trace.json").write_text(json.dumps(small))  # the same rank, shorter
    other = cuda_trace()
    del other["distributedInfo"]
    (tmp_path / "worker_rank1.json").write_text(json.dumps(other["traceEvents"]))  # bare list
    records = load_traces([tmp_path])
    assert [r["rank"] for r in records] == [1, 3]
    assert records[1]["detail"]["path"].endswith(".gz")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(MyelinError, match="not a readable JSON trace"):
        load_traces([tmp_path / "bad.json"])
    (tmp_path / "none.json").write_text('{"traceEvents": [{"ph": "M", "name": "x"}]}')
    with pytest.raises(MyelinError, match="no timed events"):
        load_traces([tmp_path / "none.json"])
    with pytest.raises(MyelinError, match="does not exist"):
        load_traces([tmp_path / "missing.json"])
    (tmp_path / "x.json").write_text('{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1}]}')
    with pytest.raises(MyelinError, match="no GPU kernels, CPU operators"):
        load_traces([tmp_path / "x.json"])
    mine = {"traceEvents": [{"ph": "X", "ts": 0, "dur": 1}], "otherData": {"producer": "myelin"}}
    (tmp_path / "trace.json").write_text(json.dumps(mine))
    with pytest.raises(MyelinError, match="pass its directory"):
        load_traces([tmp_path / "trace.json"])


def small_cpu_program(path, wait_s=0.03):
    """Train a few steps under torch.profiler; each step waits in a myelin-named range.
    Returns the seconds actually spent waiting (a loaded machine oversleeps)."""
    waited = 0.0
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(3):
            with record_function(f"ProfilerStep#{step}"):
                with record_function("0F0"):
                    loss = model(torch.randn(128, 64)).square().mean()
                with record_function("0WAIT"):
                    start = time.perf_counter()
                    time.sleep(wait_s)  # as if waiting for a message
                    waited += time.perf_counter() - start
                loss.backward()
                opt.step()
                opt.zero_grad()
    prof.export_chrome_trace(str(path))
    return waited


def test_real_cpu_trace_reports_per_rank_figures(tmp_path, capsys):
    waited = small_cpu_program(tmp_path / "rank0.json")
    parser = add_arguments(argparse.ArgumentParser())
    assert main(parser.parse_args([str(tmp_path / "rank0.json"), "--json"])) == 0
    row = json.loads(capsys.readouterr().out)["ranks"][0]
    assert row["rank"] == 0 and row["stage"] == 0 and row["device"] == "cpu"
    assert 0 < row["busy_frac"] < 1 and row["idle"]["host_wait"] > 0
    assert waited >= 0.09  # 3 sleeps of 30 ms, longer under load
    assert row["idle"]["bubble"] * row["wall_s"] == pytest.approx(waited, abs=0.01)
    assert row["busy_frac"] + sum(row["idle"].values()) == pytest.approx(1, abs=0.01)
    out = tmp_path / "o"
    assert main(parser.parse_args([str(tmp_path / "rank0.json"), "--out", str(out)])) == 0
    assert {p.name for p in out.iterdir()} >= {"summary.json", "trace.json", "timeline.png"}


def test_the_command_line_entry_point(tmp_path):
    small_cpu_program(tmp_path / "trace.json", wait_s=0.0)
    res = subprocess.run(
        [sys.executable, "-m", "myelin.profile.command", str(tmp_path / "trace.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "torch.profiler profile: 1 rank(s)" in res.stdout and "host-wait" in res.stdout
