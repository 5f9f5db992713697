"""Run real multi-process jobs from tests: hard timeout, and nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


@dataclass
class Job:
    returncode: int
    output: str
    results: dict[int, dict]  # rank -> what the worker wrote to out/rank{r}.json


def launch(
    nproc: int,
    worker: str,
    args: list[str],
    tmp: Path,
    timeout: float = 120.0,
    launcher: str = "myelin",
    env: dict[str, str] | None = None,
) -> Job:
    """Run tests/workers/`worker` in `nproc` processes and collect each rank's JSON results.

    The job runs in its own session and TMPDIR; on timeout the whole session is killed
    and the test fails. Afterwards no process of the session and no socket file remains.
    """
    out = tmp / "out"
    sockdir = tmp / "sock"
    out.mkdir(exist_ok=True)
    sockdir.mkdir(exist_ok=True)
    script = str(WORKERS / worker)
    if launcher == "myelin":
        cmd = [sys.executable, "-m", "myelin.cli", "run", "-n", str(nproc), script]
    elif launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            script,
        ]
    else:
        raise ValueError(launcher)
    full_env = {
        **os.environ,
        "TMPDIR": str(sockdir),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    proc = subprocess.Popen(
        [*cmd, "--out", str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout}s:\n{output[-5000:]}") from None
    finally:
        _reap_session(proc.pid)
    leftovers = [p.name for p in sockdir.iterdir() if p.name.startswith("myelin")]
    assert not leftovers, f"socket or segment files left behind: {leftovers}"
    results = {}
    for f in out.glob("rank*.json"):
        results[int(f.stem[4:])] = json.loads(f.read_text())
    return Job(proc.returncode, output, results)


def _zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits to be reaped (an orphan's parent is init, which
    reaps in its own time): it runs nothing and holds nothing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _reap_session(sid: int) -> None:
    """Kill anything still alive in the job's session (exited ones waiting to be reaped
    aside); fail if something was."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid and not _zombie(int(entry.name)):
                alive.append(int(entry.name))
        except (ProcessLookupError, PermissionError):
            continue
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not alive, f"processes left running after the job: {alive}"
