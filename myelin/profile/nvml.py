"""Counters sampled in the background: GPU utilization and memory (NVML), host memory.

    sampler = Sampler(torch.device("cuda", 0), origin=timeline.origin)
    sampler.start(); ...; sampler.stop()
    sampler.counters   # {"gpu util %": [[t, value], ...], "gpu memory MiB": [...], ...}

Times are seconds since `origin` on the `time.perf_counter` clock, the timeline's clock,
so the counters line up with the spans. NVML numbers GPUs its own way and ignores
CUDA_VISIBLE_DEVICES, so the rank's device is found by UUID. Where NVML is missing, the
driver is absent, the device is not a GPU, or a query is not supported (utilization
under MIG), that counter is left out without a word; nothing here ever raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from myelin.errors import ConfigError

__all__ = ["Sampler", "device_uuid", "find_handle"]

log = logging.getLogger(__name__)

_MIB = 2**20
Probe = Callable[[], float]


def _normal_uuid(uuid: str) -> str:
    """'GPU-6E3F...' and '6e3f...' name the same device; MIG UUIDs keep their prefix."""
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def device_uuid(device: Any) -> str | None:
    """The UUID CUDA reports for `device` (as NVML spells it), or None off a GPU."""
    try:
        import torch

        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception as exc:  # an old torch without .uuid, a broken driver: no GPU counters
        log.debug("no CUDA UUID for %s: %s", device, exc)
        return None
    return uuid if uuid.lower().startswith(("gpu-", "mig-")) else f"GPU-{uuid}"


def find_handle(nvml: Any, uuid: str) -> Any | None:
    """The NVML handle of the GPU (or MIG instance) with `uuid`, or None."""
    want = _normal_uuid(uuid)
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        if _normal_uuid(_text(nvml.nvmlDeviceGetUUID(handle))) == want:
            return handle
        for mig in _mig_handles(nvml, handle):
            if _normal_uuid(_text(nvml.nvmlDeviceGetUUID(mig))) == want:
                return mig
    return None


def _mig_handles(nvml: Any, handle: Any) -> list[Any]:
    try:
        if nvml.nvmlDeviceGetMigMode(handle)[0] != 1:
            return []
        count = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:  # no MIG support on this GPU or in this pynvml
        return []
    out = []
    for i in range(count):
        with contextlib.suppress(Exception):  # unused slots raise NotFound
            out.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_probes(nvml: Any, handle: Any) -> dict[str, Probe]:
    return {
        "gpu util %": lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "gpu memory MiB": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / _MIB,
    }


def _host_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _MIB


class Sampler:
    """Reads counters every `interval_s` in a daemon thread while started.

    device: the rank's device; NVML counters only for a CUDA device NVML can see.
    origin: `time.perf_counter()` value that times are measured from (the timeline's).
    host_memory: also sample this process's resident memory ("host rss MiB").
    nvml, uuid: stand-ins for pynvml and the device's UUID, for tests.
    """

    def __init__(
        self,
        device: Any = "cpu",
        interval_s: float = 0.1,
        origin: float | None = None,
        host_memory: bool = True,
        nvml: Any = None,
        uuid: str | None = None,
    ) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)):
            raise ConfigError(f"interval_s={interval_s!r} must be a number of seconds")
        if not 0.001 <= interval_s <= 60:
            raise ConfigError(f"interval_s={interval_s!r} must be in [0.001, 60] seconds")
        self.interval_s = float(interval_s)
        self.origin = time.perf_counter() if origin is None else origin
        self.counters: dict[str, list[list[float]]] = {}
        self._nvml: Any = None
        self._probes = self._open(device, nvml, uuid)
        self._probes.update(_allocator_probe(device))
        if host_memory and os.path.exists("/proc/self/statm"):
            self._probes["host rss MiB"] = _host_rss_mib
        self._probes = {k: p for k, p in self._probes.items() if _works(p)}
        if not any(name.startswith("gpu ") for name in self._probes):
            self._release()  # e.g. under MIG, where NVML answers nothing useful
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether there is anything to sample (False: start and stop do nothing)."""
        return bool(self._probes)

    @property
    def names(self) -> list[str]:
        return list(self._probes)

    def _open(self, device: Any, nvml: Any, uuid: str | None) -> dict[str, Probe]:
        uuid = uuid if uuid is not None else device_uuid(device)
        if uuid is None:
            return {}
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
        except Exception as exc:  # no library, no driver: no GPU counters
            log.debug("NVML unavailable: %s", exc)
            return {}
        self._nvml = nvml
        try:
            handle = find_handle(nvml, uuid)
        except Exception as exc:
            log.debug("NVML cannot list devices: %s", exc)
            handle = None
        if handle is None:
            self._release()
            return {}
        return _nvml_probes(nvml, handle)

    def sample(self) -> None:
        """Read every counter once, now; a counter that starts failing is dropped."""
        t = time.perf_counter() - self.origin
        for name, probe in list(self._probes.items()):
            try:
                value = probe()
            except Exception:
                del self._probes[name]
                continue
            self.counters.setdefault(name, []).append([t, value])

    def start(self) -> Sampler:
        """Begin sampling in the background (a no-op when nothing can be sampled)."""
        if self.active and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="myelin-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (one last sample is taken) and release NVML; safe to call twice."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5)
            self.sample()
        self._release()

    def _release(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _allocator_probe(device: Any) -> dict[str, Probe]:
    """torch's own count of allocated device memory, next to NVML's view of the device."""
    try:
        import torch

        device = torch.device(device)
        if device.type != "cuda":
            return {}
    except Exception:
        return {}
    return {"allocated MiB": lambda: torch.cuda.memory_allocated(device) / _MIB}


def _works(probe: Probe) -> bool:
    try:
        probe()
    except Exception:  # e.g. NVMLError_NotSupported for utilization under MIG
        return False
    return True
