"""A single-producer, single-consumer ring of messages in a shared-memory segment.

On one host a message's frames (its msgpack header and small tensors) can skip ZeroMQ:
the sender copies them into the ring of the segment it shares with the receiver, moves
`head` on, and rings the receiver's doorbell (transport.py); the receiver reads records
at `tail`, decodes them as it decodes ZeroMQ frames, and moves `tail` on. That saves
ZeroMQ's two I/O-thread hops per message, which are most of a small message's latency.

A record is `[u32 length][u32 frames][u32 frame length]...` padded to 8 bytes, then each
frame's bytes padded to 8; a length of `_WRAP` means "continue at the ring's start".
`head` and `tail` are byte counters that only grow, each an aligned 8-byte word on a
cache line of its own; each side writes one of them, through a native-format memoryview
(one 8-byte load or store; `struct`'s little-endian formats go byte by byte, and a
reader could see half a counter). The sender writes a record before it moves `head` and
the receiver reads `head` before the record: x86-64 keeps stores in order and loads in
order, so nothing else is needed there (`SUPPORTED` is x86-64 only).

The doorbell costs a system call, and waking a sleeping receiver costs the sender tens of
microseconds more, so it is rung only when the receiver says it sleeps (`sleep`, a third
word). Each side stores its word, fences, then loads the other's (Dekker's pattern): a
receiver going to sleep sees the new `head`, or the sender sees it asleep and rings. The
fence is a lock taken and given back: on x86-64 its locked instructions order every
store before every later load.

`Returns`, the rest of the header page, goes the other way: the receiver puts there the
offsets of slots whose tensors died, and the sender takes them back before it places a
tensor, so a stream reuses a few slots while they are warm in cache instead of waiting
for a credit message to bring them back.
The receiver checks every length against the ring before it reads, so a corrupt record
is a `RingError`, never a read outside the segment.
"""

from __future__ import annotations

import functools
import platform
import struct
import threading
from typing import Any

__all__ = ["SUPPORTED", "RingError", "Writer", "Reader", "Returns", "views"]

SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")
HEAD, TAIL = 64, 128  # offsets of the two counters in the segment's header page
SLEEP = 192  # the receiver's "I am about to sleep: ring the doorbell" word
_H, _T, _S = HEAD // 8, TAIL // 8, SLEEP // 8  # indexes in the page seen as 8-byte words
_RH, _RT, _R0 = 256 // 8, 320 // 8, 512 // 8  # Returns: its head, tail and first entry
_WRAP = 0xFFFFFFFF
_PREFIX = struct.Struct("<II")


class RingError(Exception):
    """A record that does not fit the ring's rules: the ring can no longer be read."""


def views(
    region: Any, page: int, ring_bytes: int, keep: list[memoryview]
) -> tuple[memoryview, memoryview]:
    """A segment's header page as native 8-byte words (where the counters live) and its
    ring's bytes (the `ring_bytes` after that page), as views kept in `keep` so that the
    segment's owner can release them before it unmaps."""
    whole = memoryview(region)
    control, data = whole[:page], whole[page : page + ring_bytes]
    words = control.cast("Q")
    keep.extend((words, control, data, whole))
    return words, data


def _pad(n: int) -> int:
    return -(-n // 8) * 8


class Writer:
    """The sending side of a ring: `put` a message's frames, or False while it is full.
    `words` is the segment's header page as native 8-byte words, `data` the ring's bytes."""

    def __init__(self, words: memoryview, data: memoryview) -> None:
        self._words, self._data = words, data
        self.size = data.nbytes
        self.max_record = self.size // 2  # so a record always fits once the ring drains
        self._head = words[_H]
        self._fence = threading.Lock()

    def put(self, frames: list) -> bool | None:
        """Copy `frames` into the ring as one record; False (nothing written) when full,
        None when a record this big can never go through it."""
        lengths = [len(f) if type(f) is bytes else f.nbytes for f in frames]
        need = _record_bytes(lengths)
        if need > self.max_record:
            return None
        head, size = self._head, self.size
        pos = head % size
        skip = size - pos if pos + need > size else 0
        if head + skip + need - self._words[_T] > size:
            return False
        data = self._data
        if skip:
            _PREFIX.pack_into(data, pos, _WRAP, 0)
            pos = 0
        _table(len(lengths)).pack_into(data, pos, need, len(lengths), *lengths)
        at = pos + _pad(8 + 4 * len(lengths))
        for frame, n in zip(frames, lengths):
            data[at : at + n] = frame
            at += _pad(n)
        self._head = head + skip + need
        self._words[_H] = self._head  # last: the record is complete
        return True

    def asleep(self) -> bool:
        """Whether the receiver may be asleep, after a `put`: then ring its doorbell."""
        with self._fence:
            pass
        return self._words[_S] != 0

    def pending(self) -> bool:
        """Whether the receiver has records still to read."""
        return self._words[_T] != self._head


def _record_bytes(lengths: list[int]) -> int:
    """The bytes a record of frames this long takes in the ring."""
    return _pad(8 + 4 * len(lengths)) + sum(map(_pad, lengths))


@functools.lru_cache(maxsize=64)
def _table(count: int) -> struct.Struct:
    """A record's prefix and its table of `count` frame lengths, packed (or read) in one
    call, without a format string made per message."""
    return struct.Struct(f"<II{count}I")


class Reader:
    """The receiving side of a ring: `take` the next record's frames, then `advance`."""

    def __init__(self, words: memoryview, data: memoryview, max_frames: int) -> None:
        self._words, self._data = words, data
        self.size = data.nbytes
        self.max_frames = max_frames
        self._tail = words[_T]
        self._taken = 0  # bytes of the record handed out by take, not yet advanced over
        self._fence = threading.Lock()

    def ready(self) -> bool:
        """Whether a record is waiting (one load of `head`)."""
        return self._words[_H] != self._tail

    def sleep(self) -> bool:
        """Say this side is about to sleep; False (and awake again) if a record came."""
        self._words[_S] = 1
        with self._fence:
            pass
        if self._words[_H] != self._tail:
            self._words[_S] = 0
            return False
        return True

    def wake(self) -> None:
        """Say this side is awake: the sender need not ring."""
        self._words[_S] = 0

    def take(self) -> list[memoryview] | None:
        """The next record's frames (views into the ring, valid until `advance`), or None."""
        head = self._words[_H]
        size, data = self.size, self._data
        while head != self._tail:
            if not 0 < head - self._tail <= size:
                raise RingError(f"head {head} is not within {size} bytes after tail {self._tail}")
            pos = self._tail % size
            if pos + 8 > size:
                raise RingError(f"record at {pos} starts past the ring's end")
            length, count = _PREFIX.unpack_from(data, pos)
            if length == _WRAP:
                self._advance_to(self._tail + size - pos)
                continue
            table = _pad(8 + 4 * count)
            if count > self.max_frames or length < table or length % 8:
                raise RingError(f"record at {pos}: length {length}, {count} frames")
            if pos + length > size or length > head - self._tail:
                raise RingError(f"record at {pos} of {length} bytes runs past what was written")
            lengths = _table(count).unpack_from(data, pos)[2:]
            at, end = pos + table, pos + length
            frames = []
            for n in lengths:
                if at + n > end:
                    raise RingError(f"record at {pos}: frames overrun its {length} bytes")
                frames.append(data[at : at + n])
                at += _pad(n)
            self._taken = length
            return frames
        return None

    def advance(self) -> None:
        """Give the record `take` returned back to the sender (its frames are dead now)."""
        if self._taken:
            self._advance_to(self._tail + self._taken)
            self._taken = 0

    def _advance_to(self, tail: int) -> None:
        self._tail = tail
        self._words[_T] = tail


class Returns:
    """Slot offsets the receiver gives back through the header page (entries from byte 512
    to the page's end): `put` on the receiver's side, `take` on the sender's."""

    def __init__(self, words: memoryview) -> None:
        self._words = words
        self.capacity = len(words) - _R0

    def put(self, offset: int) -> bool:
        """Give a slot back; False when the list is full (it goes back with a credit)."""
        words, head = self._words, self._words[_RH]
        if head - words[_RT] >= self.capacity:
            return False
        words[_R0 + head % self.capacity] = offset
        words[_RH] = head + 1  # last: the entry is written
        return True

    def take(self) -> list[int]:
        """Every offset given back since the last call (nothing to read: one load)."""
        words = self._words
        head, tail = words[_RH], words[_RT]
        if head == tail:
            return []
        if not 0 < head - tail <= self.capacity:
            raise RingError(f"returns: head {head} is not within {self.capacity} after {tail}")
        out = [words[_R0 + i % self.capacity] for i in range(tail, head)]
        words[_RT] = head
        return out
