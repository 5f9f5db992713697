"""The NVML sampler: devices found by UUID, silent without NVML, a GPU, or under MIG."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from myelin.errors import ConfigError
from myelin.profile.nvml import Sampler, find_handle


class NVMLError(Exception):
    pass


class FakeNVML:
    """pynvml's calls the sampler makes, over a list of GPUs {uuid, util, used, mig}."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[dict], init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.live = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.live += 1

    def nvmlShutdown(self) -> None:
        self.live -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, handle: dict) -> bytes:
        return handle["uuid"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle: dict) -> SimpleNamespace:
        if handle.get("util") is None:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: dict) -> SimpleNamespace:
        if handle.get("used") is None:
            raise NVMLError("Not Supported")
        return SimpleNamespace(used=handle["used"], total=80 * 2**30, free=0)

    def nvmlDeviceGetMigMode(self, handle: dict) -> list[int]:
        return [1 if handle.get("mig") else 0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: dict) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: dict, i: int) -> dict:
        migs = handle.get("mig") or []
        if i >= len(migs):
            raise NVMLError("Not Found")
        return migs[i]


GPUS = [
    {"uuid": "GPU-aaaa", "util": 10, "used": 1 * 2**20},
    {"uuid": "GPU-bbbb", "util": 77, "used": 2048 * 2**20},
    {"uuid": "GPU-cccc", "util": 30, "used": 3 * 2**20},
]


def test_the_device_is_found_by_uuid_not_by_index():
    nvml = FakeNVML(GPUS)
    # CUDA_VISIBLE_DEVICES=1 makes it cuda:0 for torch; NVML still calls it index 1.
    sampler = Sampler("cpu", uuid="GPU-BBBB", nvml=nvml, host_memory=False)
    assert sampler.names == ["gpu util %", "gpu memory MiB"]
    sampler.sample()
    assert [v for _, v in sampler.counters["gpu util %"]] == [77.0]
    assert [v for _, v in sampler.counters["gpu memory MiB"]] == [2048.0]
    assert find_handle(nvml, "bbbb") is GPUS[1]  # with or without the "GPU-" prefix


def test_background_sampling_on_the_timeline_clock():
    nvml = FakeNVML(GPUS)
    origin = time.perf_counter()
    with Sampler("cpu", 0.01, origin=origin, uuid="GPU-cccc", nvml=nvml) as sampler:
        time.sleep(0.1)
    times = [t for t, _ in sampler.counters["gpu util %"]]
    assert len(times) >= 4 and times == sorted(times)
    assert 0 <= times[0] < 0.05 and times[-1] <= time.perf_counter() - origin
    assert sampler.counters["host rss MiB"][0][1] > 1  # this process's resident memory
    assert nvml.live == 0  # shut down at stop
    sampler.stop()  # twice is fine


def test_mig_instance_without_utilization_keeps_what_works():
    mig = {"uuid": "MIG-1234", "util": None, "used": 5 * 2**20}
    nvml = FakeNVML([{"uuid": "GPU-parent", "util": 90, "used": 0, "mig": [mig]}])
    sampler = Sampler("cpu", uuid="MIG-1234", nvml=nvml, host_memory=False)
    assert sampler.names == ["gpu memory MiB"]  # utilization: NVML says not supported


def test_mig_where_nothing_is_supported_is_a_silent_no_op():
    mig = {"uuid": "MIG-1234", "util": None, "used": None}
    nvml = FakeNVML([{"uuid": "GPU-parent", "util": 90, "used": 0, "mig": [mig]}])
    sampler = Sampler("cpu", uuid="MIG-1234", nvml=nvml, host_memory=False)
    assert not sampler.active and nvml.live == 0
    sampler.start()
    sampler.stop()
    assert sampler.counters == {}


@pytest.mark.parametrize(
    "nvml",
    [
        FakeNVML(GPUS, init_error=NVMLError("NVML Shared Library Not Found")),
        FakeNVML(GPUS, init_error=NVMLError("Driver Not Loaded")),
        FakeNVML([]),  # NVML works but sees no GPU with this UUID
    ],
)
def test_no_nvml_is_a_silent_no_op(nvml, caplog):
    sampler = Sampler("cpu", uuid="GPU-aaaa", nvml=nvml, host_memory=False)
    assert not sampler.active and sampler.names == []
    with sampler:
        pass
    assert sampler.counters == {} and nvml.live <= 0
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_the_real_pynvml_on_this_machine_never_raises():
    sampler = Sampler("cuda:0", uuid="GPU-0000", host_memory=False)  # no driver here
    with sampler:
        time.sleep(0.01)
    assert sampler.counters.keys() <= {"gpu util %", "gpu memory MiB", "allocated MiB"}


def test_cpu_device_samples_host_memory_only():
    sampler = Sampler("cpu", 0.01)
    assert sampler.names == ["host rss MiB"]
    sampler.sample()
    assert len(sampler.counters["host rss MiB"]) == 1


def test_a_counter_that_starts_failing_is_dropped():
    gpu = dict(GPUS[0])
    sampler = Sampler("cpu", uuid="GPU-aaaa", nvml=FakeNVML([gpu]), host_memory=False)
    sampler.sample()
    gpu["util"] = None
    sampler.sample()
    assert sampler.names == ["gpu memory MiB"]
    assert len(sampler.counters["gpu util %"]) == 1


@pytest.mark.parametrize("interval", [0, -1, 61, True, "0.1"])
def test_bad_interval_is_refused(interval):
    with pytest.raises(ConfigError, match="interval_s"):
        Sampler("cpu", interval)
