"""The device's memory as an accounted budget: what is resident, its peak, and its limit.

On a GPU the caching allocator is capped and measured by torch.cuda. Everywhere, the
runtime also adds up the bytes it keeps on the device tier (parameters, gradients,
optimizer state, saved activations), so a machine without a GPU can enforce
`device_memory_limit` too, and a step that would pass it raises `DeviceMemoryError`.
"""

from __future__ import annotations

import torch

from myelin.errors import DeviceMemoryError
from myelin.offload.pool import human_bytes

__all__ = ["DeviceBudget", "CATEGORIES"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")

# What would shrink each category, named in the error.
_HELP = {
    "activations": "OffloadConfig(activations=True) pages saved activations out to host memory",
    "optimizer": "OffloadConfig(optimizer=True) keeps optimizer state and master weights "
    "on the host",
    "parameters": "more pipeline stages split the parameters over more devices",
    "gradients": "more pipeline stages split the gradients over more devices",
}


class DeviceBudget:
    """Bytes resident on one rank's device, by category, against an optional limit."""

    def __init__(
        self,
        device: torch.device,
        limit_bytes: int | None = None,
        *,
        where: str = "",
        offloading: tuple[str, ...] = (),
    ) -> None:
        self.device = torch.device(device)
        self.limit_bytes = limit_bytes
        self.where = where  # "rank 0 (stage 0)", for messages
        self.offloading = offloading  # categories already offloaded: not suggested again
        self.resident = dict.fromkeys(CATEGORIES, 0)
        self._total = 0  # sum(resident.values()), kept: `add` runs per saved tensor
        self.peak_bytes = 0
        self.peak_resident = dict(self.resident)
        self.measured = self.device.type == "cuda"
        if self.measured and limit_bytes is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            fraction = min(1.0, limit_bytes / total)
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    @property
    def total(self) -> int:
        return self._total

    def set(self, category: str, nbytes: int, doing: str) -> None:
        """Make `category` hold `nbytes`; raise if that passes the limit."""
        self.add(category, nbytes - self.resident[category], doing)

    def add(self, category: str, nbytes: int, doing: str) -> None:
        """Add (or with a negative count, release) bytes of `category`, checking the limit
        before anything grows, so the error leaves the counts as they were."""
        total = self._total + nbytes
        if nbytes > 0 and not self.measured and self.limit_bytes is not None:
            if total > self.limit_bytes:
                raise DeviceMemoryError(self._explain(category, nbytes, doing))
        self.resident[category] += nbytes
        self._total = total
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_resident = dict(self.resident)

    def device_peak(self) -> int:
        """The peak bytes on the device: torch.cuda's measure on a GPU, else the accounting."""
        if self.measured:
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak_bytes

    def close(self) -> None:
        """Lift the memory-fraction cap set for `limit_bytes`: it outlives the trainer."""
        if self.measured and self.limit_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def reset_peak(self) -> None:
        self.peak_bytes = self.total
        self.peak_resident = dict(self.resident)
        if self.measured:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _explain(self, category: str, nbytes: int, doing: str) -> str:
        parts = ", ".join(
            f"{k} {human_bytes(v + (nbytes if k == category else 0))}"
            for k, v in self.resident.items()
        )
        biggest = sorted(
            (c for c in CATEGORIES if c not in self.offloading),
            key=lambda c: -(self.resident[c] + (nbytes if c == category else 0)),
        )
        hints = "; ".join(_HELP[c] for c in biggest if self.resident[c] or c == category)
        return (
            f"{self.where}: {doing} needs {human_bytes(self.total + nbytes)} on the device, past "
            f"device_memory_limit={human_bytes(self.limit_bytes or 0)} (resident: {parts}). "
            f"To fit: {hints or 'raise device_memory_limit'}."
        )

    def describe_oom(self, exc: BaseException, doing: str) -> DeviceMemoryError:
        """A DeviceMemoryError for a CUDA out-of-memory error, with the accounting."""
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in self.resident.items())
        limit = (
            f"device_memory_limit={human_bytes(self.limit_bytes)}"
            if self.limit_bytes
            else "the device's memory"
        )
        hints = "; ".join(_HELP[c] for c in CATEGORIES if c not in self.offloading)
        return DeviceMemoryError(
            f"{self.where}: the device ran out of memory ({limit}) while {doing} "
            f"(accounted resident: {parts}). To fit: {hints}. ({exc})"
        )
