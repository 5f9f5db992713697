"""How a rank's ZeroMQ sockets bind, and how a message is handed to one without a copy.

Binding: `ipc://` in Linux's abstract namespace by default (no file, gone with the
process), a socket file under `ipc_dir` (its path kept under the 107-byte limit) when
asked, or `tcp://` on the configured host with a port the kernel picks.

Sending: frames go non-blocking; large ones zero-copy. pyzmq's `track=True` tracks only
the frame it is given, so each large frame is sent and tracked on its own, and its buffer
is kept alive until ZeroMQ is done reading it (frames under `zmq.COPY_THRESHOLD` are
copied by pyzmq and need nothing).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from typing import Any

import zmq

from myelin.errors import ConfigError

__all__ = ["bind", "send_frames"]

log = logging.getLogger(__name__)

_IPC_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)  # ints: enum flags cost per call


def bind(
    sock: zmq.Socket, kind: str, host: str, ipc_dir: str | None, name: str
) -> tuple[str, str | None]:
    """Bind `sock` by `kind` ("ipc" or "tcp"); returns its address and the socket file made
    (None for tcp and abstract ipc). `name` tells this socket from others of the process."""
    if kind == "tcp":
        sock.bind(f"tcp://{_bracket(host)}:0")
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode(), None
    name = f"myelin-{os.getpid()}-{name}-{uuid.uuid4().hex[:8]}.sock"
    if ipc_dir is None and sys.platform == "linux":
        address = f"ipc://@{name}"  # abstract namespace: no file to leave behind
        sock.bind(address)
        return address, None
    path = os.path.join(ipc_dir or tempfile.gettempdir(), name)
    if len(path.encode()) > _IPC_PATH_MAX:
        log.warning("ipc path %r is over %d bytes; binding in /tmp", path, _IPC_PATH_MAX)
        path = os.path.join("/tmp", name)
    if len(path.encode()) > _IPC_PATH_MAX:
        raise ConfigError(
            f"ipc socket path {path!r} is {len(path.encode())} bytes, over Linux's "
            f"{_IPC_PATH_MAX}; set TransportConfig.ipc_dir to a shorter directory"
        )
    sock.bind(f"ipc://{path}")
    return f"ipc://{path}", path


def send_frames(
    sock: zmq.Socket, frames: list, tracked: list[tuple[zmq.MessageTracker, Any]]
) -> bool:
    """Send a multipart message without blocking; False (nothing sent) if ZeroMQ would block.
    Large frames go zero-copy, each with its tracker and buffer appended to `tracked`."""
    last = len(frames) - 1
    try:
        sock.send(frames[0], flags=_NOBLOCK | (_SNDMORE if last else 0))
    except zmq.Again:
        return False
    for i in range(1, last + 1):
        more = _SNDMORE if i < last else 0
        # pyzmq tracks only the frame it was given, so track each large frame on
        # its own; small frames are copied by pyzmq and report done at once.
        if len(frames[i]) < zmq.COPY_THRESHOLD:
            sock.send(frames[i], flags=more)
            continue
        tracker = sock.send(frames[i], flags=more, copy=False, track=True)
        if not tracker.done:
            tracked.append((tracker, frames[i]))
    return True


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
