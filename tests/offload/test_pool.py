"""HostPool: views, reuse without growth, coalescing, limits, errors and threads.

Run: python -m pytest -q tests/offload/test_pool.py
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import myelin.offload.pool as pool_mod
from myelin.errors import ConfigError, HostMemoryError, MyelinError
from myelin.offload.pool import (
    HostPool,
    available_host_bytes,
    default_host_limit,
    human_bytes,
    parse_bytes,
)

GIB = 1 << 30
MIB = 1 << 20
_REAL_READ_MEMINFO = pool_mod._read_meminfo


@pytest.fixture(autouse=True)
def roomy_machine(monkeypatch):
    """Pretend the host has plenty of free memory, so results do not depend on this machine."""
    monkeypatch.setattr(pool_mod, "_read_meminfo", lambda: {"MemTotal": GIB, "MemAvailable": GIB})


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    """The [start, end) address range a tensor covers."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


# -- parse_bytes and human_bytes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (4096, 4096),
        ("4096", 4096),
        ("10B", 10),
        ("10 b", 10),
        ("100KB", 100_000),
        ("100kb", 100_000),
        ("1.5GB", 1_500_000_000),
        ("2 TB", 2 * 1000**4),
        ("512MiB", 512 * MIB),
        ("6GiB", 6 * GIB),
        ("6 gib", 6 * GIB),
        ("0.5KiB", 512),
        ("1.5 GiB", 3 * GIB // 2),
        ("1TiB", 1 << 40),
    ],
)
def test_parse_bytes_accepts(value, expected):
    assert parse_bytes(value, "host_memory_limit") == expected


@pytest.mark.parametrize(
    "value",
    [
        0,
        -1,
        True,
        False,
        1.5,
        "",
        "0",
        "0GiB",
        "-5",
        "-1GiB",
        "abc",
        "6GIB",
        "6 GiBs",
        "1e9",
        "5XB",
    ],
)
def test_parse_bytes_rejects(value):
    with pytest.raises(ConfigError) as info:
        parse_bytes(value, "host_memory_limit")
    text = str(info.value)
    assert "host_memory_limit" in text
    assert repr(value) in text
    assert "GiB" in text  # the accepted forms are listed


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (100, "100 B"), (1536, "1.5 KiB"), (3 * GIB // 2, "1.5 GiB"), (-MIB, "-1 MiB")],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


# -- allocation ---------------------------------------------------------------------------


def test_views_have_shape_dtype_and_do_not_overlap():
    pool = HostPool(slab_bytes=4096)
    requests = [
        ((3, 5), torch.float32),
        ((7,), torch.float64),
        ((2, 3, 4), torch.bfloat16),
        ((9,), torch.uint8),
        ((), torch.int64),
        ((5,), torch.bool),
        ((100, 10), torch.float16),  # 2000 bytes
        ((300,), torch.float32),  # 1200 bytes
    ]
    tensors = [pool.empty(shape, dtype, what=f"t{i}") for i, (shape, dtype) in enumerate(requests)]
    for t, (shape, dtype) in zip(tensors, requests):
        assert t.shape == torch.Size(shape) and t.dtype == dtype
        assert t.is_contiguous() and t.device.type == "cpu"
        assert t.data_ptr() % 64 == 0
        assert pool.owns(t)
    ranges = sorted(_bytes(t) for t in tensors)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start
    for i, t in enumerate(tensors):
        t.fill_(True if t.dtype == torch.bool else i + 1)
    for i, t in enumerate(tensors):
        expected = True if t.dtype == torch.bool else i + 1
        assert bool((t == expected).all()), f"allocation {i} was overwritten"
    assert pool.stats()["allocations"] == len(tensors)
    assert pool.in_use_bytes == sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)


def test_steady_state_reuses_slabs():
    pool = HostPool(slab_bytes=64 * 1024)
    sizes = [1000, 5000, 20_000, 300, 40_000, 7, 12_345]
    seen = []
    for step in range(5):
        live = [pool.empty((n,), torch.uint8, what=f"step{step}") for n in sizes]
        for t in live[::2]:  # free in an order other than allocation order
            pool.free(t)
        for t in live[1::2]:
            pool.free(t)
        assert pool.in_use_bytes == 0
        seen.append((pool.grows, pool.capacity_bytes))
    assert all(s == seen[0] for s in seen), seen


def test_freed_neighbours_coalesce():
    pool = HostPool(slab_bytes=4096)
    a, b, c, d = (pool.empty((1024,), torch.uint8) for _ in range(4))  # fills the slab
    assert pool.grows == 1 and pool.capacity_bytes == 4096
    pool.free(a)
    pool.free(c)
    pool.free(b)  # merges with both neighbours
    big = pool.empty((3072,), torch.uint8)
    assert pool.grows == 1
    assert big.data_ptr() == a.data_ptr()
    pool.free(big)
    pool.free(d)
    whole = pool.empty((4096,), torch.uint8)
    assert pool.grows == 1
    pool.free(whole)


def test_oversize_request_gets_its_own_reused_slab():
    pool = HostPool(slab_bytes=4096)
    small = pool.empty((100,), torch.uint8)
    big = pool.empty((3000,), torch.float32)  # 12000 bytes > one slab
    assert pool.grows == 2
    assert pool.capacity_bytes == 4096 + MIB  # rounded up to 1 MiB
    pool.free(big)
    again = pool.empty((3000,), torch.float32)
    assert pool.grows == 2
    pool.free(again)
    pool.free(small)


def test_zero_size_allocation():
    pool = HostPool(slab_bytes=4096)
    z = pool.empty((0,), torch.float32)
    z2 = pool.empty((3, 0, 4), torch.bfloat16)
    assert z.shape == (0,) and z2.shape == (3, 0, 4) and z2.dtype == torch.bfloat16
    assert pool.in_use_bytes == 0 and pool.grows == 0
    pool.free(z)  # accepted, nothing to give back
    pool.free(z2)
    with pytest.raises(ConfigError, match="negative"):
        pool.empty((2, -1), torch.float32)


def test_reserve_grows_once_up_front():
    pool = HostPool(slab_bytes=4096)
    pool.reserve(10_000)
    grows, capacity = pool.grows, pool.capacity_bytes
    assert capacity >= 10_000
    pool.reserve(10_000)
    live = [pool.empty((2048,), torch.uint8) for _ in range(4)]
    live.append(pool.empty((1808,), torch.uint8))  # 10_000 bytes in all, in 64-byte sizes
    assert (pool.grows, pool.capacity_bytes) == (grows, capacity)
    for t in live:
        pool.free(t)
    with pytest.raises(ConfigError):
        pool.reserve(-1)


# -- accounting ---------------------------------------------------------------------------


def test_peak_tracking_and_reset():
    pool = HostPool(slab_bytes=4096)
    a = pool.empty((1000,), torch.uint8)  # 1024 rounded
    b = pool.empty((64,), torch.uint8)
    assert pool.in_use_bytes == 1088 and pool.peak_bytes == 1088
    pool.free(a)
    assert pool.in_use_bytes == 64 and pool.peak_bytes == 1088
    pool.reset_peak()
    assert pool.peak_bytes == 64
    c = pool.empty((128,), torch.uint8)
    assert pool.peak_bytes == 192
    pool.free(b)
    pool.free(c)
    assert pool.stats() == {
        "in_use_bytes": 0,
        "peak_bytes": 192,
        "capacity_bytes": 4096,
        "adopted_bytes": 0,
        "limit_bytes": None,
        "slabs": 1,
        "grows": 1,
        "allocations": 0,
    }


def test_adopted_bytes_count_as_in_use_and_against_the_limit():
    """`adopt` answers for memory held elsewhere (a CPU device's pages): in use, peak and
    the limit see it, no slab is made, and a refusal changes nothing."""
    pool = HostPool(limit_bytes=8192, slab_bytes=4096)
    pool.adopt(1000, what="activations of microbatch 0")  # 1024 rounded
    assert (pool.in_use_bytes, pool.peak_bytes, pool.grows) == (1024, 1024, 0)
    a = pool.empty((4096,), torch.uint8)  # one slab: 4096 + 1024 of 8192
    with pytest.raises(HostMemoryError, match=r"activations of microbatch 3.*host_memory_limit"):
        pool.adopt(4000, what="activations of microbatch 3")
    assert pool.stats()["adopted_bytes"] == 1024 and pool.in_use_bytes == 5120
    with pytest.raises(HostMemoryError, match="host_memory_limit"):
        pool.empty((4096,), torch.uint8)  # a second slab would pass the limit with the adopted
    pool.disown(1000)
    pool.free(a)
    assert pool.in_use_bytes == 0 and pool.peak_bytes == 5120
    with pytest.raises(MyelinError, match="adopted"):
        pool.disown(64)


# -- limits -------------------------------------------------------------------------------


def test_limit_raises_before_allocating_and_pool_stays_usable():
    pool = HostPool(8192, slab_bytes=4096)
    a = pool.empty((4096,), torch.uint8)
    b = pool.empty((1024,), torch.float32)
    before = pool.stats()
    with pytest.raises(HostMemoryError) as info:
        pool.empty((16,), torch.float32, what="activation of stage 2")
    text = str(info.value)
    assert "8 KiB" in text  # the limit
    assert "host_memory_limit" in text and "microbatch" in text
    assert "activation of stage 2" in text
    assert pool.stats() == before
    pool.free(a)
    c = pool.empty((16,), torch.float32)
    assert pool.grows == 2 and pool.owns(c)
    pool.free(b)
    pool.free(c)


def test_last_slab_shrinks_to_fit_the_limit():
    pool = HostPool("6000", slab_bytes=4096)
    pool.empty((4096,), torch.uint8)
    t = pool.empty((1000,), torch.uint8)
    assert pool.capacity_bytes == 4096 + 1856  # the room left, in whole 64-byte units
    assert pool.owns(t)
    with pytest.raises(HostMemoryError):
        pool.empty((1000,), torch.uint8)


def test_machine_reserve_refuses_a_slab(monkeypatch):
    info = {"MemTotal": 100 * MIB, "MemAvailable": 5 * MIB + MIB // 2}
    monkeypatch.setattr(pool_mod, "_read_meminfo", lambda: info)
    pool = HostPool(slab_bytes=MIB, reserve_fraction=0.05)
    with pytest.raises(HostMemoryError, match="nearly out of memory"):
        pool.empty((16,), torch.uint8, what="optimizer state")
    assert pool.grows == 0 and pool.capacity_bytes == 0
    info["MemAvailable"] = 50 * MIB
    t = pool.empty((16,), torch.uint8)
    assert pool.grows == 1 and pool.owns(t)


def test_host_memory_numbers(monkeypatch):
    monkeypatch.setattr(pool_mod, "_read_meminfo", lambda: {"MemAvailable": 10 * GIB})
    assert available_host_bytes() == 10 * GIB
    assert default_host_limit() == 8 * GIB
    assert default_host_limit(4) == 2 * GIB
    with pytest.raises(ConfigError):
        default_host_limit(0)
    monkeypatch.setattr(pool_mod, "_read_meminfo", dict)
    assert available_host_bytes() is None
    assert default_host_limit() is None


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="no /proc/meminfo")
def test_real_meminfo_is_read():
    info = _REAL_READ_MEMINFO()
    assert 0 < info["MemAvailable"] <= info["MemTotal"]


# -- errors and threads -------------------------------------------------------------------


def test_double_free_and_foreign_tensors_raise():
    pool = HostPool(slab_bytes=4096)
    t = pool.empty((10,), torch.float32)
    pool.free(t)
    with pytest.raises(MyelinError, match="not a live allocation"):
        pool.free(t)
    with pytest.raises(MyelinError, match="not allocated by this pool"):
        pool.free(torch.zeros(10))
    other = HostPool(slab_bytes=4096)
    u = other.empty((10,), torch.float32)
    assert not pool.owns(u) and other.owns(u)
    with pytest.raises(MyelinError):
        pool.free(u)
    other.free(u)
    assert not pool.owns(torch.zeros(3))


def test_pin_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available; pinning is allowed")
    with pytest.raises(ConfigError, match="pin"):
        HostPool(pin=True)


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="host_memory_limit"):
        HostPool(0)
    with pytest.raises(ConfigError, match="slab_bytes"):
        HostPool(slab_bytes=-1)
    with pytest.raises(ConfigError, match="reserve_fraction"):
        HostPool(reserve_fraction=1.0)


def test_threads_allocate_and_free_concurrently():
    pool = HostPool(slab_bytes=16 * 1024)
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(worker: int) -> None:
        try:
            barrier.wait()
            for step in range(50):
                live = []
                for k in range(8):
                    t = pool.empty((17 + 13 * k,), torch.int32)
                    t.fill_(worker * 1000 + step * 10 + k)
                    live.append((t, worker * 1000 + step * 10 + k))
                for t, value in live:
                    assert bool((t == value).all())
                    pool.free(t)
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors, errors
    assert pool.in_use_bytes == 0 and pool.stats()["allocations"] == 0


def test_a_pinned_pool_grows_by_the_power_of_two_blocks_torch_pins(monkeypatch):
    """torch's pinned allocator rounds each block up to a power of two: the pool asks for
    that much and counts it, so its capacity and its limit are what is really pinned.
    (No pinned memory on a CPU: the allocation is made plain, the sizing is the pool's.)"""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    mib = 1 << 20
    pool = HostPool(7 * mib, slab_bytes=4 * mib, reserve_fraction=0.0)
    pool._pin = True  # as on a GPU machine
    pool.empty((3 * mib,), torch.uint8, what="a page")  # within one 4 MiB slab
    with pytest.raises(HostMemoryError, match="limit reached"):  # 3 MiB would pin 4 MiB,
        pool.empty((3 * mib,), torch.uint8, what="another")  # past the 3 MiB left
    pool.empty((2 * mib,), torch.uint8, what="a smaller one")  # a new slab
    assert pool.capacity_bytes == 6 * mib  # 4, then 2: the largest block within the limit
    with pytest.raises(HostMemoryError, match="limit reached"):
        pool.empty((2 * mib,), torch.uint8, what="a third")
    big = HostPool(slab_bytes=mib, reserve_fraction=0.0)
    big._pin = True
    big.empty((3 * mib,), torch.uint8, what="past one slab")
    assert big.capacity_bytes == 4 * mib
