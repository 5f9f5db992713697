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


_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Workers:
    """One configuration's worker processes, started once, told what to run over stdin and
    answering on stdout. `ranks` > 1 with `distributed` makes them one torch.distributed
    world on this host; otherwise they are independent."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ranks: int,
        tmp: str,
        threads: int,
        timeout_s: float,
        distributed: bool = True,
    ) -> None:
        self.name, self.timeout_s = name, timeout_s
        slug = name.replace(" ", "-")
        self.logs = [os.path.join(tmp, f"{slug}-{r}.log") for r in range(ranks)]
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env.update(OMP_NUM_THREADS=str(threads), TMPDIR=tmp, PYTHONUNBUFFERED="1")
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.replies: list[queue.Queue] = []
        for rank, log in enumerate(self.logs):
            rank_env = dict(env)
            if distributed and ranks > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
                rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            with open(log, "w") as err:
                proc = subprocess.Popen(
                    argv, env=rank_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=err, text=True,
                )  # fmt: skip
            self.procs.append(proc)
            self.replies.append(reader(proc))

    def wait(self) -> list[dict[str, Any]]:
        """Every rank's next reply; a dead or silent rank raises with its log's tail."""
        deadline = time.monotonic() + self.timeout_s
        out = []
        for rank, replies in enumerate(self.replies):
            try:
                got = replies.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                got = None
            if got is None:
                tail = Path(self.logs[rank]).read_text()[-3000:]
                raise RuntimeError(f"{self.name} rank {rank} gave no answer:\n{tail}")
            out.append(got)
        return out

    def ask(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        send_all(self.procs, cmd)
        return self.wait()

    def close(self) -> None:
        """Ask every rank to quit; kill what is still running after a while."""
        stop_all(self.procs, 30)
