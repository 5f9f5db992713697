"""What a rank knows of the launcher that started it (`myelin run` or torchrun).

A launcher that dies (SIGKILL, the OOM killer) can no longer stop its ranks, so each rank
watches it: the launcher is the parent the rank had when it started, and the rank is
orphaned once its parent changes (the heartbeat thread looks, see liveness.py). Under
`myelin run` a rank also tells the launcher, through an inherited pipe, where it wrote
its flight record, so the launcher's last line can say.
"""

from __future__ import annotations

import os
import stat

__all__ = ["FD_ENV", "PID_ENV", "launcher_pid", "tell", "under_myelin_run"]

FD_ENV = "MYELIN_LAUNCHER_FD"  # the write end of the launcher's pipe
PID_ENV = "MYELIN_LAUNCHER_PID"


def launcher_pid() -> int | None:
    """The launcher's pid if this process was started by one (myelin run, torchrun) and it
    is still this process's parent; None when started by hand (a parent shell may go)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and PID_ENV not in os.environ:
        return None
    parent = os.getppid()
    named = os.environ.get(PID_ENV, "")
    if named.isdigit() and int(named) != parent:
        return None  # started by a launcher, but through some other process: not ours to watch
    return parent if parent > 1 else None


def under_myelin_run() -> bool:
    """Whether `myelin run` started this process (and is still its parent)."""
    named = os.environ.get(PID_ENV, "")
    return named.isdigit() and int(named) == os.getppid()


def tell(line: str) -> None:
    """Write one line to `myelin run` (best effort: the launcher may be gone)."""
    fd, launcher = os.environ.get(FD_ENV, ""), os.environ.get(PID_ENV, "")
    if not (fd.isdigit() and launcher.isdigit() and int(launcher) == os.getppid()):
        return  # a process the rank started inherits the variables, not the pipe
    try:
        if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return
    except OSError:
        return
    data = (line.replace("\n", " ") + "\n").encode()[:4096]  # one write up to PIPE_BUF: whole
    try:
        os.write(int(fd), data)
    except OSError:
        pass
