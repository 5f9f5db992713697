"""Files written whole or not at all, by any number of writers at once.

SPMD scripts run the same lines on every rank, so two processes (or a rank's heartbeat
thread and its main thread) may write one file at the same moment. Each writer writes a
temporary file of its own beside the target (pid, thread and a random part in its name)
and renames it over the target, so a reader sees the old file or a whole new one, the
last rename wins, and no writer can take another's temporary file away.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomic"]


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes | str | Callable[[BinaryIO], object],
    *,
    durable: bool = False,
) -> Path:
    """Write `data` (bytes, text, or a function writing to a binary file) to `path`.

    The directory is created if missing. `durable`: fsync the file and its directory
    before returning, so the file survives a power cut (checkpoints).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
    tmp = target.with_name(f".{target.name}.{tag}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return target
