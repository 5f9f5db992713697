"""Fixtures shared by the runtime's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from myelin.runtime.transport import Transport, TransportConfig


@pytest.fixture
def transports() -> Iterator[Callable[[TransportConfig], tuple[Transport, Transport]]]:
    """Make two transports (rank 0 and 1) in this process from a config; all are closed
    after the test."""
    made: list[Transport] = []

    def make(cfg: TransportConfig) -> tuple[Transport, Transport]:
        store = dist.HashStore()
        a, b = Transport(0, 2, store, cfg), Transport(1, 2, store, cfg)
        made.extend((a, b))
        return a, b

    yield make
    for t in made:
        t.close()
