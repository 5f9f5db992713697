"""First-fit allocation of aligned byte ranges: the slots of a shared-memory segment.

First fit keeps slots low in the segment, so memory is committed only as far as a
stream reaches, and a slot given back is the next one taken while it is warm in cache.
"""

from __future__ import annotations

import bisect

__all__ = ["ALIGN", "SlotAllocator"]

ALIGN = 64  # slot alignment: a cache line, enough for every dtype and vector unit


class SlotAllocator:
    """First-fit allocator of aligned byte ranges in [base, base + capacity)."""

    def __init__(self, base: int, capacity: int, align: int = ALIGN) -> None:
        self.align = align
        self.base = base
        self.capacity = capacity
        self.used = 0
        self._free: list[tuple[int, int]] = [(base, capacity)]  # (offset, size), sorted
        self._taken: dict[int, int] = {}  # offset -> size

    def alloc(self, nbytes: int) -> int | None:
        """Reserve `nbytes` and return the offset, or None when no free range is big enough."""
        size = max(self.align, -(-nbytes // self.align) * self.align)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._taken[offset] = size
                self.used += size
                return offset
        return None

    def free(self, offset: int) -> None:
        """Return a slot; raises KeyError for an offset that is not allocated."""
        size = self._taken.pop(offset)
        self.used -= size
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]  # merge with the next free range
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, prev = self._free.pop(i - 1)
            size += prev
            i -= 1
        self._free.insert(i, (offset, size))
