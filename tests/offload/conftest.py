"""Fixtures the offload unit tests share."""

from __future__ import annotations

import pytest
import torch

import myelin.offload.pool as pool_mod

GIB = 1 << 30


@pytest.fixture(scope="module")
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds spinning on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def roomy_machine(monkeypatch):
    """Pretend the host has plenty of free memory, so results do not depend on this machine."""
    monkeypatch.setattr(pool_mod, "_read_meminfo", lambda: {"MemTotal": GIB, "MemAvailable": GIB})
