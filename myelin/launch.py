"""`myelin run`: N local processes, started as torchrun starts them and stopped together.

    code = launch(2, "train.py", ["--lr", "1e-3"])     # the exit status for the shell

The launcher hosts the rendezvous store (as torchrun's agent does, so no port is picked
and freed and raced for) on a socket it binds before the first rank starts, serving it
once they run (its torch import overlaps theirs). Each rank runs in a process group of
its own with torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and the TORCHELASTIC_* variables that point ranks at that
store. Then, every 50 ms:
1. a rank killed by a signal (without saying it failed), else one that said it raised an
   error (through the pipe, before its slow exit), else one that exited non-zero, is the
   first failure; a frozen (SIGSTOPped) rank is killed as soon as a rank said it failed,
   since it cannot act on the failed rank's abort. Once a rank exited non-zero every
   other rank gets SIGTERM and, after `grace_s`, SIGKILL; the exit status is the first
   failure's;
2. SIGINT (Ctrl-C), SIGTERM or SIGHUP to the launcher stops every rank the same way (with
   SIGINT, which a rank ends on quietly) and prints one line: interrupted, which ranks
   were stopped, where their flight records are; the exit status is 128 + the signal.
Ranks say where they wrote flight records through a pipe (`MYELIN_LAUNCHER_FD`, see
runtime/launched.py), and watch the launcher: if it dies they stop. Nothing is written
to the temp folder.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from myelin.errors import ConfigError
from myelin.runtime.launched import FD_ENV, PID_ENV

__all__ = ["launch", "GRACE_S"]

GRACE_S = 5.0  # default seconds a stopped rank gets between SIGTERM and SIGKILL
_POLL_S = 0.05
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(slots=True)
class _Rank:
    rank: int
    proc: subprocess.Popen
    code: int | None = None  # exit status once it ended (negative: killed by that signal)
    stopped: bool = False  # it was still running when the launcher stopped the job
    flight: list[str] = field(default_factory=list)  # flight records it reported
    failed: int = 0  # it said it raised an error (and is on its way out): 1 told first, ...
    joining: bool = False  # it entered the world's rendezvous (a Trainer being built)
    joined: bool = False  # it got through it


def launch(
    nproc: int,
    script: str,
    args: Sequence[str] = (),
    master_port: int | None = None,
    master_addr: str = "127.0.0.1",
    module: bool = False,
    grace_s: float = GRACE_S,
) -> int:
    """Run `script` (a module with `module=True`) in `nproc` local processes; exit status."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)):
        raise ConfigError(f"grace_s={grace_s!r} must be a number of seconds")
    if not 0 <= grace_s <= 3600:
        raise ConfigError(f"grace_s={grace_s!r} must be in [0, 3600] seconds")
    listener = _listen(master_addr, master_port)
    store = None
    reader, writer = os.pipe()
    os.set_blocking(reader, False)
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: caught.append(signum)) for s in _STOP_SIGNALS}
    ranks: list[_Rank] = []
    try:
        env = _environment(nproc, master_addr, listener.getsockname()[1], writer)
        cmd = [sys.executable, "-u", *(["-m"] if module else []), script, *args]
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            proc = subprocess.Popen(cmd, env=rank_env, pass_fds=(writer,), process_group=0)
            ranks.append(_Rank(rank, proc))
        os.close(writer)
        writer = -1
        store = _host_store(listener)  # ranks wait in the listen queue meanwhile
        return _supervise(ranks, reader, caught, grace_s)
    finally:
        _stop(ranks, grace_s)  # only if something above went wrong: nobody is left running
        for s, handler in previous.items():
            signal.signal(s, handler)
        for fd in (reader, writer):
            if fd >= 0:
                os.close(fd)
        listener.close()  # a no-op once the store took it over
        del store


def _listen(addr: str, port: int | None) -> socket.socket:
    """The rendezvous socket, listening on `addr` (loopback by default) before any rank
    starts: ranks that connect before the store serves it wait in its queue."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            addr.strip("[]"), port or 0, type=socket.SOCK_STREAM
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(where)
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
    except OSError as exc:
        at = f"{addr}:{port}" if port else addr
        raise ConfigError(f"myelin run: cannot serve the rendezvous at {at}: {exc}") from None
    return listener


def _host_store(listener: socket.socket):
    """The rendezvous store every rank joins, served from this process on `listener` (the
    store takes the socket over). torch is imported here, while the ranks import theirs."""
    from torch.distributed import TCPStore

    host, port = listener.getsockname()[:2]
    fd = listener.detach()
    try:
        return TCPStore(host, port, None, True, wait_for_workers=False, master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        os.close(fd)
        raise ConfigError(
            f"myelin run: cannot serve the rendezvous at {host}:{port}: {exc}"
        ) from None


def _environment(nproc: int, addr: str, port: int, writer: int) -> dict[str, str]:
    """torchrun's environment for the ranks of one node, minus its error files."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.update(
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=f"myelin-{uuid.uuid4().hex[:12]}",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store above; no rank hosts one
    )
    env[FD_ENV] = str(writer)
    env[PID_ENV] = str(os.getpid())
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    return env


def _supervise(ranks: list[_Rank], reader: int, caught: list[int], grace_s: float) -> int:
    """Wait for every rank; stop the rest at the first failure or at a signal."""
    pending = b""
    first: _Rank | None = None
    while True:
        pending = _read_reports(ranks, reader, pending)
        for r in ranks:
            if r.code is None:
                r.code = r.proc.poll()
        told = sorted((r for r in ranks if r.failed), key=lambda r: r.failed)
        exited = [r for r in ranks if r.code]
        if first is None and (told or exited):
            first = _first(told, exited)
        if told:  # the others are being told by the failed rank; a frozen one cannot hear
            for r in ranks:
                if r.code is None and _frozen(r.proc.pid):
                    r.stopped = True
                    _signal_group(r.proc.pid, signal.SIGKILL)
        running = [r for r in ranks if r.code is None]
        stranded = _stranded(ranks)
        if caught or exited or not running or stranded:
            break
        time.sleep(_POLL_S)
    _stop(ranks, grace_s, signal.SIGINT if caught else signal.SIGTERM)
    _read_reports(ranks, reader, pending)
    if stranded and not caught and first is None:
        gone, waiting = stranded
        print(
            f"myelin run: rank {gone.rank} exited (code {gone.code}) without joining the "
            f"world that rank{'s' if len(waiting) > 1 else ''} "
            f"{', '.join(str(r.rank) for r in waiting)} waited in, to build a Trainer (every "
            f"rank must build it); {_stopped(ranks)}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if caught:
        signum = caught[0]
        print(f"myelin run: interrupted ({signal.Signals(signum).name}); {_stopped(ranks)}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + signum
    codes = {r.rank: r.code for r in ranks}
    if first is None or not any(codes.values()):  # every rank ended well (one that raised
        return 0  # and told, then caught its error and went on, too)
    print(
        f"myelin run: rank {first.rank} failed first (exit code {first.code}); exit codes by "
        f"rank: {codes}; {_stopped(ranks)}; see its error above",
        file=sys.stderr,
        flush=True,
    )
    return first.code if first.code is not None and 0 < first.code < 256 else 1


def _stranded(ranks: list[_Rank]) -> tuple[_Rank, list[_Rank]] | None:
    """(a rank that ended well without joining the world, the ranks waiting in its
    rendezvous), which can never complete without it; None when there is no such pair."""
    gone = [r for r in ranks if r.code == 0 and not r.joined]
    waiting = [r for r in ranks if r.code is None and r.joining and not r.joined]
    return (gone[0], waiting) if gone and waiting else None


def _first(told: list[_Rank], exited: list[_Rank]) -> _Rank:
    """The rank that failed first, from the first poll that saw a failure: one killed by
    a signal without having said it failed (SIGKILL, a crash), as the ranks that said so
    in the same poll may only have seen it die; else the first that said it raised (it is
    on its slow way out); else the first that exited non-zero."""
    killed = [r for r in exited if r.code is not None and r.code < 0 and not r.failed]
    return (killed or told or exited)[0]


def _stop(ranks: list[_Rank], grace_s: float, signum: int = signal.SIGTERM) -> None:
    """Signal every rank still running (its whole process group; SIGINT after Ctrl-C, which
    ranks end quietly on, else SIGTERM), and SIGKILL it after grace_s; a stopped (frozen)
    rank at once, as it cannot act on a signal."""
    running = [r for r in ranks if r.proc.poll() is None]
    for r in running:
        r.stopped = True
        _signal_group(r.proc.pid, signal.SIGKILL if _frozen(r.proc.pid) else signum)
    deadline = time.monotonic() + grace_s
    while any(r.proc.poll() is None for r in running) and time.monotonic() < deadline:
        time.sleep(0.02)
    for r in running:
        if r.proc.poll() is None:
            _signal_group(r.proc.pid, signal.SIGKILL)
        r.code = r.proc.wait()


def _frozen(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger): it can act on no signal."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _read_reports(ranks: list[_Rank], reader: int, pending: bytes) -> bytes:
    """Take the lines ranks wrote to the pipe: `flight RANK PATH`, `failed RANK`,
    `joining RANK` and `joined RANK` (around the world's rendezvous)."""
    while True:
        try:
            chunk = os.read(reader, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        pending += chunk
    *lines, pending = pending.split(b"\n")
    for line in lines:
        kind, _, rest = line.decode(errors="replace").partition(" ")
        rank, _, path = rest.partition(" ")
        if kind == "failed" and rank.isdigit() and int(rank) < len(ranks):
            ranks[int(rank)].failed = 1 + max(r.failed for r in ranks)  # in order of telling
        if kind in ("joining", "joined") and rank.isdigit() and int(rank) < len(ranks):
            ranks[int(rank)].joining = True
            ranks[int(rank)].joined = ranks[int(rank)].joined or kind == "joined"
        if kind == "flight" and rank.isdigit() and int(rank) < len(ranks) and path:
            if path not in ranks[int(rank)].flight:
                ranks[int(rank)].flight.append(path)
    return pending


def _stopped(ranks: list[_Rank]) -> str:
    """'stopped ranks 0, 1; flight records: ...' for the launcher's one line."""
    stopped = [str(r.rank) for r in ranks if r.stopped]
    what = (
        f"stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(stopped)}"
        if stopped
        else ("no rank needed stopping")
    )
    flights = [p for r in ranks for p in r.flight]
    return (
        f"{what}; flight records: {', '.join(flights)}"
        if flights
        else (f"{what}; no flight record was written")
    )
