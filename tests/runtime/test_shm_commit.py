"""A shared-memory segment commits memory as its slots are used, not its whole size.

Issue 11: each directed pair of ranks committed its 256 MiB segment at the first large
send (512 MiB resident per rank of a 2-stage job whose activations were 96 KiB).
"""

from __future__ import annotations

import pytest
import torch

from myelin.runtime import shm

pytestmark = pytest.mark.skipif(not shm.SUPPORTED, reason="needs memfd_create (Linux)")

MiB = 2**20


def test_memory_is_committed_as_slots_reach_into_the_segment():
    segment = shm.Segment(256 * MiB)
    try:
        assert segment.committed <= MiB + 4096  # the header page and the first step
        offsets = [segment.put(torch.ones(24 * 1024)) for _ in range(4)]  # 4 x 96 KiB
        assert None not in offsets
        assert segment.committed <= 2 * MiB, segment.committed
        big = torch.arange(3 * MiB // 4, dtype=torch.float32)  # 3 MiB more: it grows
        offset = segment.put(big)
        assert offset is not None and offset + 3 * MiB <= segment.committed <= 8 * MiB
        view = torch.frombuffer(segment._map, dtype=torch.uint8)[offset : offset + 3 * MiB]
        assert torch.equal(view.view(torch.float32), big)  # the bytes are the tensor's
        del view
    finally:
        segment.close()
