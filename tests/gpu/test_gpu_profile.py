"""The profiler on a GPU: CUDA-event timings against the wall clock, NVML counters in the trace.

Timings: an operation's span is read from CUDA events recorded around it, so it is the
device's time, which may start after the CPU launched it (the device is still busy with
earlier work). With the device idle and one known-length kernel (torch.cuda._sleep) a span
must match the kernel's time by CUDA events of the test's own within SPAN_RTOL +
SPAN_ATOL_S (a span timed on the host would be the launch alone, some microseconds), never
exceed the wall time from launch to synchronize, and start within START_TOL_S of the
launch; queued back to back, spans must follow each other without gaps larger than
GAP_TOL_S, as the device ran them.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import myelin
from myelin.models import GPT, GPTConfig, lm_loss
from myelin.profile.report import ProfileConfig
from myelin.profile.timeline import KINDS, Timeline
from tests.gpu._gpu import batches, gpu_count, needs_gpus

pytestmark = pytest.mark.gpu

SPAN_RTOL, SPAN_ATOL_S = 0.05, 0.2e-3
START_TOL_S = 2e-3
GAP_TOL_S = 0.5e-3


def _cycles_per_s() -> float:
    """The GPU's clock as torch.cuda._sleep counts it, after a first spin raised it."""
    torch.cuda._sleep(2_000_000)
    torch.cuda.synchronize()
    cycles = 20_000_000
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return cycles / (time.perf_counter() - start)


def test_cuda_event_spans_match_wall_time(fresh_device):
    line = Timeline(0, 0, enabled=True, device="cuda:0")
    rate = _cycles_per_s()
    with line.op("forward", "0F9", 0, microbatch=9):  # the first op creates its events
        torch.cuda._sleep(int(0.001 * rate))
    for i, target_s in enumerate((0.002, 0.01, 0.04)):
        torch.cuda.synchronize()
        launched = line.now()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with line.op("forward", f"0F{i}", 0, microbatch=i):
            begin.record()
            torch.cuda._sleep(int(target_s * rate))
            end.record()
        torch.cuda.synchronize()
        wall = line.now() - launched
        kernel = begin.elapsed_time(end) / 1e3
        span = line.spans[-1]
        took = span.end - span.start
        assert abs(took - kernel) <= SPAN_RTOL * kernel + SPAN_ATOL_S, (target_s, took, kernel)
        assert took <= wall + SPAN_ATOL_S, (target_s, took, wall)
        assert abs(span.start - launched) <= START_TOL_S, (span.start, launched)
    assert line.busy_s == pytest.approx(sum(s.end - s.start for s in line.spans))


def test_queued_operations_are_timed_as_the_device_ran_them(fresh_device):
    line = Timeline(0, 0, enabled=True, device="cuda:0")
    cycles = int(0.02 * _cycles_per_s())
    torch.cuda.synchronize()
    launched = line.now()
    for i in range(4):  # the CPU launches all four in microseconds
        with line.op("backward", f"0B{i}", 0, microbatch=i):
            torch.cuda._sleep(cycles)
    launch_s = line.now() - launched
    torch.cuda.synchronize()
    wall = line.now() - launched
    spans = line.spans[-4:]
    assert launch_s < 0.02, launch_s  # else the test shows nothing: the CPU waited
    for a, b in zip(spans, spans[1:]):
        assert 0 <= b.start - a.end <= GAP_TOL_S, (a, b)
    total = spans[-1].end - spans[0].start
    assert abs(total - wall) <= SPAN_RTOL * wall + START_TOL_S, (total, wall)


@needs_gpus(2, "a stage device other than the current one")
def test_spans_time_the_stage_device_not_the_current_one(fresh_device):
    """A rank on cuda:1 whose current device was never set (torch's current device stays
    cuda:0) must still time its own device's work."""
    torch.cuda.set_device(0)
    line = Timeline(1, 0, enabled=True, device="cuda:1")
    a = torch.randn(4096, 4096, device="cuda:1")
    torch.cuda.synchronize(1)
    launched = line.now()
    with line.op("forward", "0F0", 0, microbatch=0):
        for _ in range(20):
            a = a @ a.T / 4096  # kernels on cuda:1, launched with cuda:0 current
    torch.cuda.synchronize(1)
    wall = line.now() - launched
    span = line.spans[-1]
    assert abs((span.end - span.start) - wall) <= SPAN_RTOL * wall + START_TOL_S, (span, wall)


def test_a_gpu_bound_step_is_busy_for_most_of_its_wall_time(fresh_device):
    """The step's forward, backward and optimizer spans (device time) cover most of the
    step's wall time when the kernels are large, and never more than all of it."""
    cfg = GPTConfig(vocab_size=256, block_size=512, n_layer=4, n_head=8, d_model=1024)
    torch.manual_seed(0)
    profile = ProfileConfig(print_summary=False, warmup_steps=1)
    with myelin.Trainer(
        GPT(cfg),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        lm_loss,
        microbatches=4,
        profile=profile,
    ) as trainer:
        steps = batches(cfg, 4, 16)
        walls = []
        for x in steps:
            torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.step(x[:, :-1], x[:, 1:])
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        spans = trainer.timeline.spans
    for step in range(1, len(steps)):  # the first one builds kernels and caches
        busy = sum(s.end - s.start for s in spans if s.step == step and KINDS[s.kind] == "compute")
        assert busy <= walls[step] * (1 + SPAN_RTOL) + SPAN_ATOL_S, (step, busy, walls[step])
        assert busy >= 0.7 * walls[step], (step, busy, walls[step])


# -- NVML ------------------------------------------------------------------------------------


def _mig() -> bool | None:
    """Whether this process's GPU is a MIG instance (None if NVML cannot say)."""
    try:
        import pynvml
    except ImportError:
        return None
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    if uuid.lower().startswith("mig-"):
        return True
    try:
        pynvml.nvmlInit()
        try:
            from myelin.profile.nvml import device_uuid, find_handle

            handle = find_handle(pynvml, device_uuid("cuda:0"))
            if handle is None:
                return None
            try:
                return bool(pynvml.nvmlDeviceGetMigMode(handle)[0])
            except pynvml.NVMLError:
                return False
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def test_nvml_readings_are_counter_tracks_in_the_trace(fresh_device, tmp_path):
    pytest.importorskip("pynvml", reason="needs NVML's Python bindings (nvidia-ml-py)")
    mig = _mig()
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=8, d_model=512)
    torch.manual_seed(0)
    out = tmp_path / "prof"
    profile = ProfileConfig(out_dir=str(out), interval_s=0.01, print_summary=False)
    with myelin.Trainer(
        GPT(cfg),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        lm_loss,
        microbatches=4,
        profile=profile,
    ) as trainer:
        assert trainer.sampler is not None
        names = set(trainer.sampler.names)
        start = time.perf_counter()
        for x in batches(cfg, 200, 32):  # about 2 s of GPU work, many samples
            trainer.step(x[:, :-1], x[:, 1:])
            if time.perf_counter() - start > 2.0:
                break
    trace = json.loads((out / "trace.json").read_text())
    counters: dict[str, list[float]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "C":
            counters.setdefault(event["name"], []).extend(event["args"].values())
    assert "allocated MiB" in counters, (names, sorted(counters))
    # NVML's memory reading works on whole GPUs and MIG instances alike
    assert "gpu memory MiB" in counters, (
        f"no NVML memory counter (MIG: {mig}); the sampler found {sorted(names)}: "
        f"the rank's GPU was not matched to an NVML device by UUID"
    )
    assert max(counters["gpu memory MiB"]) >= max(counters["allocated MiB"]) > 0
    if mig:
        return  # NVML answers "not supported" for utilization on a MIG instance
    util = counters.get("gpu util %")
    assert util, (names, sorted(counters))
    assert all(0 <= u <= 100 for u in util) and max(util) > 0, util


@needs_gpus(2, "CUDA and NVML numbering apart")
def test_nvml_finds_the_gpu_by_uuid_not_by_index():
    """With CUDA_VISIBLE_DEVICES naming the last GPU, cuda:0 is that GPU: the sampler's
    NVML handle must be NVML's device of that index (CUDA numbered in PCI order)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        pytest.skip("CUDA_VISIBLE_DEVICES is set: this test picks a physical GPU itself")
    last = gpu_count() - 1
    code = (
        "import pynvml, torch\n"
        "from myelin.profile.nvml import device_uuid, find_handle\n"
        "pynvml.nvmlInit()\n"
        "h = find_handle(pynvml, device_uuid('cuda:0'))\n"
        "print(pynvml.nvmlDeviceGetIndex(h))\n"
    )
    root = str(Path(__file__).resolve().parents[2])  # myelin, importable from the checkout
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(last), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    env["PYTHONPATH"] = path
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert int(got.stdout.strip().splitlines()[-1]) == last, got.stdout
