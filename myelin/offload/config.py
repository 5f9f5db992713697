"""What to page out to host memory, and how: `OffloadConfig`, checked when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from myelin.errors import ConfigError
from myelin.offload.pool import human_bytes, parse_bytes

__all__ = ["OffloadConfig", "OPTIMIZER_MODES", "PRECISIONS"]

# Where the optimizer's state lives and where its update runs:
#   device  the ordinary way: state and update on the device (no offload);
#   host    state and fp32 master weights in the host pool, update on the host;
#   stream  state in the host pool, update on the device, state streamed through in buckets.
OPTIMIZER_MODES = ("device", "host", "stream")
PRECISIONS = ("fp32", "bf16", "fp16")
_MAX_AHEAD_LAYERS = 1024  # an int above this is more likely bytes given without a unit


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """CPU scratch memory: page activations and optimizer state out to a host pool.

    activations: page tensors saved for backward out to the host after each forward and
        prefetch them back before their backward.
    optimizer: True (the default mode for the device: "host" on a CPU, "stream" on a GPU),
        "host", "stream", or False / "device" (no optimizer offload).
    min_bytes: saved tensors smaller than this stay on the device (a copy costs more).
    prefetch: microbatches waiting in the pipeline whose first layers are brought back
        ahead of their backward.
    fetch_ahead: how far ahead of backward pages come back, within one microbatch: an int
        counts layers (1: the copy for layer i-1 runs while backward computes layer i), a
        byte count such as "64MiB" counts bytes (whole pages, at least one: less than a
        layer lowers the peak further, at the cost of less time to hide each copy; 0 keeps
        nothing ahead). As much stays on the device behind the forward, so a backward that
        follows its forward at once (one stage, the last stage) starts without waiting.
        Default 1.
    host_memory_limit: bytes or "48GiB" the pool may hold; default 80% of the memory
        available at start, shared by the ranks of this host.
    slab_bytes: the pool grows in slabs of this size.
    bucket_bytes: gradients and weights move between device and host in buckets this big.
    """

    activations: bool = False
    optimizer: bool | str = False
    min_bytes: int | str = "64KiB"
    prefetch: int = 1
    fetch_ahead: int | str = 1
    host_memory_limit: int | str | None = None
    slab_bytes: int | str = "64MiB"
    bucket_bytes: int | str = "32MiB"

    def __post_init__(self) -> None:
        if not isinstance(self.activations, bool):
            raise ConfigError(f"OffloadConfig.activations={self.activations!r} must be True/False")
        opt = self.optimizer
        if not (isinstance(opt, bool) or opt in OPTIMIZER_MODES):
            raise ConfigError(
                f"OffloadConfig.optimizer={opt!r} must be True, False or one of "
                f"{', '.join(repr(m) for m in OPTIMIZER_MODES)}"
            )
        if type(self.prefetch) is not int or not 0 <= self.prefetch <= 64:
            raise ConfigError(f"OffloadConfig.prefetch={self.prefetch!r} must be an int in [0, 64]")
        self.ahead()  # checks fetch_ahead
        _bytes(self, "min_bytes", minimum=0)
        _bytes(self, "host_memory_limit", allow_none=True)
        _bytes(self, "slab_bytes", minimum=1 << 20)
        _bytes(self, "bucket_bytes")

    def ahead(self) -> tuple[int, int | None]:
        """`fetch_ahead` as (layers, bytes): bytes is None when it counts layers."""
        value = self.fetch_ahead
        if type(value) is int and 0 <= value <= _MAX_AHEAD_LAYERS:
            return value, None
        if isinstance(value, str):
            try:
                return 1, parse_bytes(value, "OffloadConfig.fetch_ahead")
            except ConfigError as exc:
                why = f" ({str(exc).split(': ', 1)[-1].split(';')[0]})"
        else:
            why = ""
        raise ConfigError(
            f"OffloadConfig.fetch_ahead={value!r} must be a number of layers from 0 to "
            f"{_MAX_AHEAD_LAYERS}, or a byte count as a string such as '64MiB'{why}"
        )

    @property
    def enabled(self) -> bool:
        """Whether anything is paged out at all."""
        return self.activations or self.optimizer not in (False, "device")

    def optimizer_mode(self, device_type: str) -> str:
        """The resolved optimizer mode on a device of this type.

        True picks "stream" on a GPU: moving fp32 state over PCIe both ways (about 24 bytes
        a parameter) is faster than torch's foreach AdamW on a few host cores, which makes
        several passes over 16 bytes a parameter. On a CPU both are the same host copies,
        and "host" skips the staging buffers.
        """
        if self.optimizer is True:
            return "stream" if device_type == "cuda" else "host"
        if self.optimizer is False:
            return "device"
        return str(self.optimizer)


def _bytes(cfg: Any, name: str, minimum: int = 1, allow_none: bool = False) -> None:
    """Parse a byte-count field in place; errors name the field, the value as given and
    the smallest value allowed."""
    value = getattr(cfg, name)
    if value is None:
        if allow_none:
            return
        raise ConfigError(f"OffloadConfig.{name}=None must be a byte count, e.g. 4096 or '64KiB'")
    if minimum == 0 and value == 0 and type(value) is int:
        return
    try:
        parsed = parse_bytes(value, f"OffloadConfig.{name}")
    except ConfigError:
        if isinstance(value, int) and not isinstance(value, bool) and value < minimum:
            raise ConfigError(
                f"OffloadConfig.{name}={value!r} must be at least {human_bytes(minimum)}"
            ) from None
        raise
    if parsed < minimum:
        raise ConfigError(f"OffloadConfig.{name}={value!r} must be at least {human_bytes(minimum)}")
    object.__setattr__(cfg, name, parsed)


def check_precision(precision: str) -> str:
    """`precision` if it is one myelin trains in, else a ConfigError naming the choices."""
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision={precision!r} must be one of {', '.join(repr(p) for p in PRECISIONS)}"
        )
    return precision
