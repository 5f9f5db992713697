"""Which host a rank is on, and whether a process there is alive: what heartbeats and
the launcher look at directly for ranks that share a host."""

from __future__ import annotations

import os
import socket

__all__ = ["host_id", "pid_alive"]


def host_id() -> str:
    """This host as ranks must share it to see each other's processes and abstract ipc
    sockets: the hostname, the network namespace and the pid namespace."""
    spaces = []
    for ns in ("net", "pid"):
        try:
            spaces.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            spaces.append("-")
    return f"{socket.gethostname()}/{'/'.join(spaces)}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (killed, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
