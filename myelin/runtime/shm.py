"""Shared-memory segments that carry large tensors between two ranks on one host.

A sender owns one anonymous segment per receiver (`memfd_create`: nothing appears in
/dev/shm, and the memory goes away with the last process that maps it, killed or not).
It copies a tensor into a free slot and sends only the slot's location; the receiver
maps the segment once, through /proc/<pid>/fd/<fd>, and wraps slots as tensors without
a copy. A slot returns to the sender only after the receiver's tensor has died.

A segment's size is only its ceiling: memory is committed as slots reach into it
(first-fit keeps them low), in steps that double, each committed at once
(MADV_POPULATE_WRITE) so a machine out of memory sends inline instead of failing later
with SIGBUS. Neither side populates the rest of the mapping.

A segment may also hold a ring of whole messages (`ring.py`) between its header page and
its slots, committed when the segment is made: headers and small tensors then skip
ZeroMQ too.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import secrets
import stat
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from myelin.runtime import doorbell
from myelin.runtime import ring as rings
from myelin.runtime.slots import ALIGN, SlotAllocator

__all__ = [
    "SUPPORTED",
    "ShmError",
    "SlotAllocator",
    "Segment",
    "Mapping",
    "Wait",
    "SendSide",
    "ReceiveSide",
]

log = logging.getLogger(__name__)

SUPPORTED = sys.platform == "linux" and hasattr(os, "memfd_create")
_PAGE = mmap.PAGESIZE
_MAGIC = b"MYELINSH"
_NAME = "myelin-shm"
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python names it in 3.12
_FIRST_COMMIT = 1 << 20  # the first step of committed memory past the header page
_memmove = ctypes.memmove


class ShmError(Exception):
    """A segment could not be created or mapped; the caller falls back to inline frames."""


class Segment:
    """The sending side: one memfd segment, its slots, and the offer that lets a peer map it;
    with `ring_bytes`, also the ring that carries whole messages (`self.ring`)."""

    def __init__(self, capacity: int, ring_bytes: int = 0) -> None:
        self.token = secrets.randbits(62) + 1
        self.ring_bytes = ring_bytes
        base = _PAGE + ring_bytes  # header page, ring, then slots
        self.size = base + capacity
        self.fd: int | None = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)  # a ceiling: nothing is committed yet
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
            self.committed = 0
            if not self._commit(base, grow=False):  # no MADV_POPULATE_WRITE: all now
                os.posix_fallocate(self.fd, 0, self.size)
                self.committed = self.size
        except OSError as exc:
            os.close(self.fd)
            raise ShmError(f"cannot create a {self.size}-byte segment: {exc}") from exc
        self._map[: len(_MAGIC) + 8] = _MAGIC + self.token.to_bytes(8, "little")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = self._bytes.data_ptr()
        self.slots = SlotAllocator(base, capacity)
        self._views: list[memoryview] = []
        self.ring: rings.Writer | None = None
        self.returns: rings.Returns | None = None  # slots the receiver gives straight back
        if ring_bytes:
            words, data = rings.views(self._map, _PAGE, ring_bytes, self._views)
            self.ring, self.returns = rings.Writer(words, data), rings.Returns(words)

    def _commit(self, end: int, grow: bool = True) -> bool:
        """Commit memory up to `end` (doubling what is committed, at least, when `grow`);
        False if the machine has none to give."""
        if end <= self.committed:
            return True
        target = end
        if grow:
            target = min(self.size, max(end, 2 * self.committed, self.slots.base + _FIRST_COMMIT))
        target = -(-target // _PAGE) * _PAGE
        try:
            self._map.madvise(_POPULATE_WRITE, self.committed, target - self.committed)
        except OSError:
            return False
        self.committed = target
        return True

    def offer(self) -> dict[str, Any]:
        """What a peer on this host needs to map the segment."""
        offer = {"pid": os.getpid(), "fd": self.fd, "size": self.size, "token": self.token}
        return {**offer, "ring": self.ring_bytes}

    def put(self, tensor: torch.Tensor) -> int | None:
        """Copy a host tensor into a free slot and return its offset, or None if full."""
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        nbytes = tensor.nbytes
        offset = self.slots.alloc(nbytes)
        if offset is None:
            return None
        if offset + nbytes > self.committed and not self._commit(offset + nbytes):
            self.slots.free(offset)  # no memory to commit: the tensor goes inline
            return None
        # One plain memmove (the GIL released): no tensor views to build per message, and
        # glibc's copy is a few microseconds faster than torch's on a slot that is not in cache.
        _memmove(self._base + offset, tensor.data_ptr(), nbytes)
        return offset

    def close_fd(self) -> None:
        """Drop the descriptor once the peer has mapped: the mappings keep the memory."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self.ring = self.returns = None
        for view in self._views:
            view.release()
        del self._bytes
        self._map.close()


class Mapping:
    """The receiving side: a peer's segment mapped here; slots become tensors without a copy."""

    def __init__(self, offer: dict[str, Any], max_frames: int = 0) -> None:
        pid, fd, size, token = (offer.get(k) for k in ("pid", "fd", "size", "token"))
        ring_bytes = offer.get("ring", 0)
        if not all(type(v) is int and v >= 0 for v in (pid, fd, size, token, ring_bytes)):
            raise ShmError(f"malformed shared-memory offer {offer!r}")
        if ring_bytes % 8 or _PAGE + ring_bytes >= size:
            raise ShmError(f"shared-memory offer's ring of {ring_bytes} bytes does not fit")
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            if target.startswith(f"/memfd:{_NAME}"):
                local = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise ShmError(f"cannot open {path}: {exc}") from exc
        if not target.startswith(f"/memfd:{_NAME}"):
            raise ShmError(f"{path} is {target}, not a myelin segment")
        try:
            info = os.fstat(local)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size or size <= _PAGE:
                raise ShmError(f"{path} is {info.st_size} bytes, the offer said {size}")
            self._map = mmap.mmap(local, size, flags=mmap.MAP_SHARED)  # pages as slots come
        except ShmError:
            raise
        except OSError as exc:
            raise ShmError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(local)
        if self._map[: len(_MAGIC) + 8] != _MAGIC + token.to_bytes(8, "little"):
            self._map.close()
            raise ShmError(f"{path} does not carry the offered token")
        self.token = token
        self.size = size
        self._base = _PAGE + ring_bytes  # where slots start
        self._view = memoryview(self._map)
        self._views: list[memoryview] = []
        self.ring: rings.Reader | None = None
        self.returns: rings.Returns | None = None
        self.gated = True  # the ring is read from the sender's `ring_start` on
        if ring_bytes and max_frames:
            words, data = rings.views(self._map, _PAGE, ring_bytes, self._views)
            self.ring, self.returns = rings.Reader(words, data, max_frames), rings.Returns(words)

    def tensor(
        self,
        offset: int,
        nbytes: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        watch: Callable[[memoryview], None],
    ) -> torch.Tensor:
        """Wrap a slot as a tensor; `watch(view)` is given the slot's memoryview, which dies
        with the last tensor that uses it (the caller hangs the slot's release on that)."""
        if offset < self._base or offset % ALIGN or offset + nbytes > self.size or nbytes == 0:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) is outside the segment")
        view = self._view[offset : offset + nbytes]
        watch(view)
        return torch.frombuffer(view, dtype=dtype).view(shape)

    def close(self) -> None:
        """Unmap now if no tensor still uses the segment; otherwise the last tensor unmaps it."""
        self.ring = self.returns = None
        for view in self._views:
            view.release()
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # tensors alive: the mapping lives until they die


class Wait(Exception):
    """No free slot yet, but one will come back soon: the message should wait, not go inline."""


class SendSide:
    """Shared memory towards one receiver: the segment, its handshake, and waits for slots.

    state: "idle" (no segment yet), "offered" (the peer is mapping it), "ready", or "off".
    """

    def __init__(self, capacity: int, wait_s: float, ring_bytes: int = 0) -> None:
        self.capacity = -(-capacity // ALIGN) * ALIGN
        self.ring_bytes = -(-ring_bytes // 8) * 8
        self.wait_s = wait_s
        self.bell: bytes | None = None  # the receiver's doorbell, once it maps the ring
        self.state = "idle"
        self.segment: Segment | None = None
        self.wait_until: float | None = None  # the waiting message goes inline after this
        self.starved = False  # a wait timed out: go inline until a slot comes back

    def offer(self) -> dict[str, Any] | None:
        """Create the segment and return the offer for the peer; None (and "off") on failure."""
        try:
            self.segment = Segment(self.capacity, self.ring_bytes)
        except ShmError as exc:
            log.warning("no shared memory (%s); sending inline", exc)
            self.state = "off"
            return None
        self.state = "offered"
        return {"op": "shm_offer", **self.segment.offer()}

    def ready(self, token: Any, bell: Any = None) -> bool:
        """The peer mapped the segment: from now on large tensors go through it, and whole
        messages through its ring when the peer gave a doorbell (`bell`) to ring."""
        if self.segment is None or token != self.segment.token:
            return False
        self.segment.close_fd()
        self.state = "ready"
        if self.segment.ring is not None and doorbell.is_bell(bell):
            self.bell = doorbell.address(bell)
        return True

    @property
    def ring(self) -> rings.Writer | None:
        """The ring to send whole messages through, once the peer reads it."""
        return self.segment.ring if self.bell is not None and self.state == "ready" else None

    def refused(self, reason: Any) -> None:
        log.warning("the peer cannot map shared memory (%s); sending inline", reason)
        self.close()
        self.state = "off"

    def place(self, tensor: torch.Tensor, inflight: int) -> list[int] | None:
        """Copy `tensor` into a slot and return its location; None sends it inline.

        Raises Wait while slots can still come back: while the peer has not taken all that
        was sent (`inflight`), then for at most `wait_s`; a wait that times out sends
        inline until a slot is freed, so a receiver that holds every slot never stalls us.
        """
        self.take_returns()
        offset = self.segment.put(tensor)
        if offset is not None:
            self.wait_until = None
            return [self.segment.token, offset]
        nbytes = tensor.numel() * tensor.element_size()
        if self.starved or -(-nbytes // ALIGN) * ALIGN > self.capacity:
            return None
        if inflight:
            self.wait_until = None
            raise Wait
        now = time.monotonic()
        if self.wait_until is None:
            self.wait_until = now + self.wait_s
        if now < self.wait_until:
            raise Wait
        self.starved, self.wait_until = True, None
        return None

    def take_returns(self) -> None:
        """Free the slots the receiver gave straight back through the segment."""
        returns = self.segment.returns if self.state == "ready" else None
        if returns is None:
            return
        try:
            offsets = returns.take()
        except rings.RingError as exc:
            log.warning("%s; slots come back with credits only", exc)
            self.segment.returns = None
            return
        if offsets and self.free(offsets):
            log.warning("the receiver gave back slots that are not in use")

    def unplace(self, offsets: list[int]) -> None:
        """Give back slots of a message that did not leave after all."""
        for offset in offsets:
            self.segment.slots.free(offset)

    def owns(self, token: Any) -> bool:
        """Whether `token` is this segment's secret (so a free of its slots is genuine)."""
        return self.segment is not None and token == self.segment.token

    def free(self, offsets: list[Any]) -> int:
        """Take back slots the receiver released; returns how many offsets were not ours."""
        bad = 0
        for offset in offsets:
            try:
                self.segment.slots.free(offset)
            except (AttributeError, KeyError, TypeError):
                bad += 1
        self.starved = False
        return bad

    def close(self) -> None:
        self.bell = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class _SlotRef(weakref.ref):
    """A weak reference to a slot's memoryview that knows which slot to give back."""

    __slots__ = ("slot",)


class ReceiveSide:
    """Peers' segments mapped here, and the slots whose tensors died, waiting to go back.

    A slot is watched by a plain weak reference to its memoryview (the tensor holds the
    view): its callback queues the slot, on whichever thread dropped the last tensor.
    `weakref.finalize` did the same at about 6 us more a message.
    """

    def __init__(self, max_frames: int = 0) -> None:
        self.max_frames = max_frames  # 0: read no rings
        self._mappings: dict[int, Mapping] = {}
        self._released: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
        # Keeps each reference (and so its callback) alive, by id: a writable view is not
        # hashable, and neither is a weak reference to one.
        self._watched: dict[int, _SlotRef] = {}
        watched, released = self._watched, self._released  # no reference back to self

        def died(ref: _SlotRef) -> None:
            watched.pop(id(ref), None)
            released.put(ref.slot)

        self._died = died

    def accept(self, src: int, offer: dict[str, Any]) -> dict[str, Any]:
        """Map `src`'s offered segment; returns the reply for it (ready, or refused and why)."""
        try:
            mapping = Mapping(offer, self.max_frames)
        except ShmError as exc:
            log.warning("cannot map rank %d's segment: %s", src, exc)
            return {"op": "shm_refused", "reason": str(exc)}
        old = self._mappings.pop(src, None)
        if old is not None:
            old.close()
        self._mappings[src] = mapping
        return {"op": "shm_ready", "token": mapping.token}

    def rings(self) -> list[tuple[int, rings.Reader]]:
        """(src, reader) of every mapped segment whose ring this side reads."""
        return [
            (src, m.ring)
            for src, m in self._mappings.items()
            if m.ring is not None and not m.gated
        ]

    def open_ring(self, src: int, token: Any) -> bool:
        """Read `src`'s ring from now on: its `ring_start` came over ZeroMQ after every
        message it sent there, so nothing in the ring can pass them. False if unknown."""
        mapping = self._mappings.get(src)
        if mapping is None or mapping.ring is None or token != mapping.token:
            return False
        mapping.gated = False
        return True

    def drop_ring(self, src: int) -> None:
        """Stop reading `src`'s ring (it broke the ring's rules); its slots still work."""
        mapping = self._mappings.get(src)
        if mapping is not None:
            mapping.ring = None

    def token_of(self, src: int) -> Any:
        """The token of `src`'s mapped segment, or None."""
        mapping = self._mappings.get(src)
        return mapping.token if mapping is not None else None

    def tensor(
        self, src: int, loc: list[int], dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
    ) -> torch.Tensor:
        """The tensor at `loc` = [token, offset] in `src`'s segment; ValueError if invalid."""
        mapping = self._mappings.get(src)
        if mapping is None or len(loc) != 2 or loc[0] != mapping.token:
            raise ValueError(f"no shared segment {loc} from rank {src}")
        slot = (src, loc[1], nbytes)

        def watch(view: memoryview) -> None:
            ref = _SlotRef(view, self._died)
            ref.slot = slot
            self._watched[id(ref)] = ref

        return mapping.tensor(loc[1], nbytes, dtype, shape, watch)

    def give_back(self, src: int, offset: int) -> bool:
        """Hand a dead slot straight back to `src` through its segment; False if it must go
        back with a credit (no ring mapped, or the list is full)."""
        mapping = self._mappings.get(src)
        return mapping is not None and mapping.returns is not None and mapping.returns.put(offset)

    def released(self) -> list[tuple[int, int, int]]:
        """(src, offset, nbytes) of every slot whose tensor died since the last call."""
        if self._released.empty():
            return []
        out = []
        while not self._released.empty():
            out.append(self._released.get_nowait())
        return out

    def close(self) -> None:
        for mapping in self._mappings.values():
            mapping.close()  # tensors still alive keep their pages until they die
        self._mappings.clear()
