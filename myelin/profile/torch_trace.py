"""Read traces written by torch.profiler and split the device's idle time by cause.

    myelin profile rank0.pt.trace.json rank1.pt.trace.json    # or the directory of them

Any PyTorch program's trace works (`export_chrome_trace`, `tensorboard_trace_handler`;
one file per rank, .json or .json.gz). On a GPU trace, the device is busy while a kernel,
memcpy or memset runs on any stream; NCCL kernels are communication, and the time only
they run is collective wait. Every other gap is classified as Holistic Trace Analysis
(HTA) does, by the kernel that ends it:

- host wait: that kernel was launched (its CUDA runtime call) after the gap began, so
  the host was not enqueuing work fast enough;
- short gap: shorter than `short_gap_us` (HTA's 30 ns), the cost of back-to-back launches;
- other: anything else, e.g. a kernel waiting for an event or a synchronization.

A CPU-only trace has no launch queue: the operators (`cpu_op`) are the busy time and each
gap between them is host wait by the same rule (the next operator began after the
previous ended). Ranges named in myelin's notation (`record_function("1F3")`,
`"1WAIT"`, `"1RECV_B2"`) are read too: time a myelin wait covers is a bubble, as in
myelin's own profile. HTA itself counts only NCCL kernels as communication, so a
pipeline's ZeroMQ traffic looks like idle time there; here it is a bubble only where
myelin's ranges say so.
"""

from __future__ import annotations

import bisect
import gzip
import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from myelin.errors import MyelinError
from myelin.profile.accounting import merge_intervals
from myelin.profile.records import RANK_FORMAT, SPAN_FIELDS
from myelin.profile.timeline import Span

__all__ = ["load_traces", "read_trace", "find_traces", "to_record"]

log = logging.getLogger(__name__)

GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
GPU_CATS |= {"memcpy": "memcpy", "memset": "memset"}  # older Kineto spellings
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "runtime"}
_COLLECTIVE = ("gloo:", "nccl:", "c10d::", "record_param_comms")
_MYELIN = re.compile(r"^(\d+)(F|B|SEND_F|SEND_B|RECV_F|RECV_B|OPT|ALLREDUCE|WAIT)(\d*)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def read_trace(path: str | Path) -> dict[str, Any]:
    """One trace file (.json or .json.gz) as a dict with 'traceEvents'."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MyelinError(f"{path}: not a readable JSON trace ({exc})") from exc
    if isinstance(data, list):  # the bare-array form of the Trace Event Format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise MyelinError(f"{path}: no 'traceEvents' list; not a Chrome/torch.profiler trace")
    return data


def find_traces(paths: Iterable[str | Path]) -> list[Path]:
    """The trace files named, and those (*.json, *.json.gz) inside directories named."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted([*p.glob("*.json"), *p.glob("*.json.gz")])
            out += [f for f in found if f.name != "summary.json"]
        elif p.exists():
            out.append(p)
        else:
            raise MyelinError(f"{p} does not exist")
    if not out:
        raise MyelinError(f"no trace files in {', '.join(map(str, paths))}")
    return out


def load_traces(paths: Sequence[str | Path], short_gap_us: float = 0.03) -> list[dict[str, Any]]:
    """Rank records (as `records.collect` makes) from torch.profiler traces, one per rank.

    The rank comes from the trace's distributedInfo, else a 'rank<N>' in the file name,
    else the file's position. Where a rank has several traces (one per profiler cycle),
    the one with the most events is used.
    """
    if short_gap_us < 0:
        raise MyelinError(f"short_gap_us={short_gap_us} must be >= 0")
    best: dict[int, tuple[int, Path, dict[str, Any]]] = {}
    for i, path in enumerate(find_traces(paths)):
        trace = read_trace(path)
        rank = _rank_of(trace, path, i)
        size = len(trace["traceEvents"])
        if rank in best:
            log.info("rank %d has several traces; using the largest", rank)
        if rank not in best or size > best[rank][0]:
            best[rank] = (size, path, trace)
    return [to_record(t, r, short_gap_us, str(p)) for r, (_, p, t) in sorted(best.items())]


def _rank_of(trace: dict[str, Any], path: Path, index: int) -> int:
    info = trace.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = re.search(r"rank[_-]?(\d+)", path.name)
    return int(m.group(1)) if m else index


def to_record(
    trace: dict[str, Any], rank: int = 0, short_gap_us: float = 0.03, path: str = ""
) -> dict[str, Any]:
    """One torch.profiler trace as a rank record: device spans, idle gaps, myelin ranges."""
    if trace.get("otherData", {}).get("producer") == "myelin":
        raise MyelinError(
            f"{path or 'trace'} is a trace myelin wrote; pass its directory: myelin profile DIR"
        )
    events = [e for e in trace["traceEvents"] if _is_slice(e)]
    if not events:
        raise MyelinError(f"{path or 'trace'}: no timed events ('ph': 'X') to analyse")
    gpu = [e for e in events if str(e.get("cat", "")).lower() in GPU_CATS]
    t0 = min(e["ts"] for e in events)
    steps = _steps(events)
    if gpu:
        spans, detail = _gpu_spans(gpu, events, steps, short_gap_us)
    else:
        spans, detail = _cpu_spans(events, steps)
    marks = _myelin_spans(events)
    spans += marks
    for s in spans:  # microseconds on the trace's clock -> seconds since t0
        if s.step < 0:
            s.step = _step_at(steps, s.start)
        s.start, s.end = (s.start - t0) / 1e6, (s.end - t0) / 1e6
    base = trace.get("baseTimeNanoseconds")
    stages = {int(_MYELIN.match(s.name).group(1)) for s in marks}
    detail.update(path=path, device_type="cuda" if gpu else "cpu", short_gap_us=short_gap_us)
    return {
        "format": RANK_FORMAT,
        "version": 1,
        "source": "torch.profiler",
        "rank": rank,
        "stage": stages.pop() if len(stages) == 1 else None,
        "replica": None,
        "device": _device(gpu),
        "wall_origin": (base / 1e9 if isinstance(base, (int, float)) else 0.0) + t0 / 1e6,
        "span_fields": list(SPAN_FIELDS),
        "spans": [[getattr(s, f) for f in SPAN_FIELDS] for s in spans],
        "counters": {},
        "detail": detail,
    }


def _is_slice(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and e.get("ph") == "X"
        and isinstance(e.get("ts"), (int, float))
        and isinstance(e.get("dur"), (int, float))
    )


def _device(gpu: list[dict[str, Any]]) -> str:
    devices = sorted({e.get("args", {}).get("device", 0) for e in gpu})
    return ", ".join(f"cuda:{d}" for d in devices) if gpu else "cpu"


# -- steps -----------------------------------------------------------------------------------


def _steps(events: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(start, end, number) of each ProfilerStep#N range, in order."""
    out = []
    for e in events:
        m = _STEP.match(str(e.get("name", "")))
        if m:
            out.append((e["ts"], e["ts"] + e["dur"], int(m.group(1))))
    return sorted(out)


def _step_at(steps: list[tuple[float, float, int]], ts: float) -> int:
    """The step whose range holds `ts` (else the last one begun before it, else the first)."""
    if not steps:
        return 0
    i = bisect.bisect_right(steps, (ts, float("inf"), 0)) - 1
    return steps[max(i, 0)][2]


# -- GPU traces --------------------------------------------------------------------------------


def _gpu_spans(
    gpu: list[dict[str, Any]],
    events: list[dict[str, Any]],
    steps: list[tuple[float, float, int]],
    short_gap_us: float,
) -> tuple[list[Span], dict[str, Any]]:
    """A span per kernel, memcpy and memset; HTA's idle gaps, for the device and per stream."""
    launches = {}
    for e in events:
        if str(e.get("cat", "")).lower() in RUNTIME_CATS:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e["ts"]
    kernels = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        args = e.get("args", {})
        stream = args.get("stream", e.get("tid"))
        name = str(e.get("name", ""))
        kind = GPU_CATS[str(e["cat"]).lower()]
        launch = launches.get(args.get("correlation"))
        step = _step_at(steps, e["ts"] if launch is None else launch)  # the launching step
        span = Span(kind, name, f"stream {stream}", step, e["ts"], e["ts"] + e["dur"])
        if "nccl" in name.lower():
            span.kind, span.cause = "collective", "collective_wait"
        kernels.append((span, launch))
    gaps = _device_gaps(kernels, short_gap_us)
    detail = {"streams": _stream_breakdown(kernels, short_gap_us), "kernels": len(kernels)}
    return [s for s, _ in kernels] + gaps, detail


def _classify(gap_start: float, gap_end: float, launch: float | None, short_us: float) -> str:
    if launch is not None and launch > gap_start:
        return "host_wait"
    return "short_gap" if gap_end - gap_start < short_us else "other"


def _device_gaps(kernels: list[tuple[Span, float | None]], short_us: float) -> list[Span]:
    """The times no kernel runs on any stream, each classified by the kernel that ends it."""
    first_launch: dict[float, float | None] = {}
    for span, launch in kernels:
        if span.start not in first_launch:
            first_launch[span.start] = launch
        elif launch is not None:
            old = first_launch[span.start]
            first_launch[span.start] = launch if old is None else min(old, launch)
    busy = merge_intervals((s.start, s.end) for s, _ in kernels)
    gaps = []
    for (_, prev_end), (nxt, _) in zip(busy, busy[1:]):
        cause = _classify(prev_end, nxt, first_launch.get(nxt), short_us)
        gaps.append(Span("gap", cause.replace("_", " "), "idle", -1, prev_end, nxt, cause=cause))
    return gaps


def _stream_breakdown(
    kernels: list[tuple[Span, float | None]], short_us: float
) -> dict[str, dict[str, float]]:
    """HTA's per-stream idle time breakdown, in seconds: gaps between kernels of a stream."""
    out: dict[str, dict[str, float]] = {}
    prev_end: dict[str, float] = {}
    for span, launch in kernels:  # sorted by start
        stream = span.track
        row = out.setdefault(stream, {"host_wait": 0.0, "short_gap": 0.0, "other": 0.0})
        if stream in prev_end:
            gap = max(span.start - prev_end[stream], 0.0)
            row[_classify(prev_end[stream], span.start, launch, short_us)] += gap / 1e6
        prev_end[stream] = max(prev_end.get(stream, span.end), span.end)
    return out


# -- CPU traces --------------------------------------------------------------------------------


def _cpu_spans(
    events: list[dict[str, Any]], steps: list[tuple[float, float, int]]
) -> tuple[list[Span], dict[str, Any]]:
    """Top-level operators per thread as busy time, collectives apart, gaps as host wait."""
    spans = []
    ends: dict[Any, float] = {}
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        name = str(e.get("name", ""))
        collective = name.startswith(_COLLECTIVE)
        if e["cat"] == "user_annotation" and not collective:
            continue
        tid = e.get("tid")
        if e["ts"] < ends.get(tid, float("-inf")):
            continue  # inside an operator already counted
        ends[tid] = e["ts"] + e["dur"]
        kind, cause = ("collective", "collective_wait") if collective else ("cpu_op", None)
        spans.append(Span(kind, name, f"thread {tid}", -1, e["ts"], ends[tid], cause=cause))
    if steps:
        lo, hi = steps[0][0], max(end for _, end, _ in steps)
    elif spans:
        lo, hi = min(s.start for s in spans), max(s.end for s in spans)
    else:
        raise MyelinError("no GPU kernels, CPU operators or profiler steps in the trace")
    busy = merge_intervals((max(s.start, lo), min(s.end, hi)) for s in spans)
    edges = [(lo, lo), *busy, (hi, hi)]
    for (_, prev_end), (nxt, _) in zip(edges, edges[1:]):
        if nxt > prev_end:
            spans.append(Span("gap", "host wait", "idle", -1, prev_end, nxt, cause="host_wait"))
    return spans, {"operators": sum(s.kind == "cpu_op" for s in spans)}


# -- myelin's own ranges ----------------------------------------------------------------------


def _myelin_spans(events: list[dict[str, Any]]) -> list[Span]:
    """Ranges named in myelin's notation (record_function('1F3'), '1WAIT', ...) as spans."""
    out = []
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        m = _MYELIN.match(str(e.get("name", "")))
        if m is None:
            continue
        op, mb = m.group(2), int(m.group(3)) if m.group(3) else None
        kind, cause = "mark", None
        if op in ("WAIT", "RECV_F", "RECV_B"):
            kind, cause = "wait", "bubble"
        elif op == "ALLREDUCE":
            kind, cause = "allreduce", "collective_wait"
        elif op.startswith("SEND"):
            kind = "send"
        end = e["ts"] + e["dur"]
        out.append(Span(kind, e["name"], "myelin", -1, e["ts"], end, microbatch=mb, cause=cause))
    return out
