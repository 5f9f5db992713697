"""What every benchmark shares: timing, summaries, a printed table, and JSON with machine info."""

from __future__ import annotations

import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of `fn` takes, on the monotonic high-resolution clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements, with the raw samples kept."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": list(samples),
    }


def fmt_size(nbytes: int) -> str:
    """4096 -> '4 KiB', 67108864 -> '64 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    """Print rows as an aligned plain-text table (first column left, the rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        first = row[0].ljust(widths[0])
        return "  ".join([first] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])])

    if title:
        print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))


def machine_info(**extra: Any) -> dict[str, Any]:
    """Where a result was measured: host, CPU, cores, memory, Python and library versions."""
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
    }
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]  # others sharing the host
    except OSError:
        pass
    for module in ("torch", "zmq", "msgpack"):
        try:
            info[module] = __import__(module).__version__
        except (ImportError, AttributeError):
            pass
    info.update(extra)
    return info


def write_json(name: str, payload: dict[str, Any], path: str | Path | None = None) -> Path:
    """Write a result under bench/results/<name>.json (or `path`) with machine info and time."""
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "machine": machine_info(),
        **payload,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


# -- worker processes that a parent drives over stdin/stdout ------------------------------

TAG = "@bench "  # prefix of a worker's protocol lines on stdout


def reply(obj: dict[str, Any]) -> None:
    """A worker's answer to its parent: one tagged JSON line on stdout."""
    print(TAG + json.dumps(obj), flush=True)


def reader(proc: subprocess.Popen) -> queue.Queue:
    """A queue of the process's protocol replies; None once its stdout closes."""
    replies: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            if line.startswith(TAG):
                replies.put(json.loads(line[len(TAG) :]))
        replies.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return replies


def send_all(procs: Sequence[subprocess.Popen], cmd: dict[str, Any]) -> None:
    """One JSON command line to every worker still running."""
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.stdin.write(json.dumps(cmd) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass


def stop_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """Ask every worker to quit; kill what is still running after `timeout_s`."""
    send_all(procs, {"quit": True})
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def timed_steps(step: Callable[[Any], Any], batches: Sequence[Any]) -> list[float]:
    """Run the steps back to back; the seconds between consecutive step ends."""
    ends = [time.perf_counter()]
    for mbs in batches:
        step(mbs)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]
