"""A host memory pool: a few large CPU slabs, sub-allocated and reused every step, that hold
paged-out activations, fp32 master weights, gradients and optimizer state under a byte limit.

Allocating big host tensors per step is slow (pinned memory especially) and fragments the
heap; the pool grows once, then the steady state allocates nothing and fails loudly, with the
numbers, before the machine swaps or meets the OOM killer.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from myelin.errors import ConfigError, HostMemoryError, MyelinError

__all__ = [
    "HostPool",
    "available_host_bytes",
    "default_host_limit",
    "human_bytes",
    "parse_bytes",
]

ALIGN = 64  # bytes; every allocation starts on and is rounded up to this boundary
_MIB = 1 << 20
_LASTING_SLAB = 8 * _MIB  # lasting state grows in smaller slabs: a small model needs little
_DEFAULT_LIMIT_FRACTION = 0.8
_FIX_HINT = (
    "raise OffloadConfig(host_memory_limit=...), or lower microbatch size / turn off an offload"
)

_UNITS = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_BYTES_FORMS = "a positive int, or a string like '4096', '100KB', '1.5GB', '512MiB', '6GiB'"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pinned_block(n: int) -> int:
    """The bytes torch's pinned allocator holds for a request of `n`: a power of two."""
    return 1 << (n - 1).bit_length()


def human_bytes(n: int) -> str:
    """Format a byte count for error messages and logs: 1536 -> '1.5 KiB', 100 -> '100 B'."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    if n < 1024:
        return f"{sign}{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{sign}{text} {unit}"


def _unit_multiplier(unit: str) -> int | None:
    """The multiplier of a unit; letters are case-insensitive except the binary 'i'."""
    if unit == "":
        return 1
    if len(unit) == 3 and unit[1] != "i":
        return None  # "GIB" is ambiguous between GB and GiB; ask for the exact spelling
    return _UNITS.get(unit.upper())


def parse_bytes(value: int | str | None, name: str) -> int | None:
    """A byte count from an int or a string such as '6GiB', '1.5GB' or '4096'; None stays None.

    KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024. A fractional result is
    rounded to the nearest byte. Raises ConfigError naming `name` for anything else, or <= 0.
    """
    if value is None:
        return None

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{name}={value!r}: {why}; expected {_BYTES_FORMS}")

    if isinstance(value, bool) or not isinstance(value, int | str):
        raise bad(f"not a byte count (got {type(value).__name__})")
    if isinstance(value, int):
        nbytes = value
    else:
        match = _BYTES_RE.match(value)
        multiplier = _unit_multiplier(match.group(2)) if match else None
        if match is None or multiplier is None:
            raise bad("cannot read it as a byte count")
        nbytes = round(Fraction(match.group(1)) * multiplier)
    if nbytes <= 0:
        raise bad("must be more than 0 bytes")
    return nbytes


def _read_meminfo() -> dict[str, int]:
    """/proc/meminfo as bytes by field name; empty where it cannot be read (not Linux)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                    info[key.strip()] = int(parts[0]) * scale
    except OSError:
        return {}
    return info


def available_host_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable); None if
    unknown."""
    return _read_meminfo().get("MemAvailable")


def default_host_limit(local_ranks: int = 1) -> int | None:
    """A default pool limit: 80% of the memory available now, split evenly between the
    `local_ranks` processes sharing this host; None if the available memory is unknown."""
    if isinstance(local_ranks, bool) or not isinstance(local_ranks, int) or local_ranks < 1:
        raise ConfigError(f"local_ranks={local_ranks!r}: expected an int >= 1")
    available = available_host_bytes()
    if available is None:
        return None
    return int(available * _DEFAULT_LIMIT_FRACTION) // local_ranks


@dataclass(slots=True)
class _Slab:
    """One slab and its free ranges as (offset, size), sorted by offset and never adjacent."""

    data: torch.Tensor
    free: list[tuple[int, int]] = field(default_factory=list)
    lasting: bool = False  # holds state that lives across steps, apart from scratch pages

    def take(self, size: int) -> int | None:
        """First fit: carve `size` bytes off the first free range that holds them."""
        for i, (offset, free_size) in enumerate(self.free):
            if free_size >= size:
                if free_size == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, free_size - size)
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        """Return a range, merging it with the free neighbours it touches."""
        i = bisect.bisect_left(self.free, (offset, 0))
        if i < len(self.free) and offset + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            offset, size = self.free[i - 1][0], self.free[i - 1][1] + size
            i -= 1
            del self.free[i]
        self.free.insert(i, (offset, size))

    def largest_free(self) -> int:
        return max((size for _, size in self.free), default=0)


class HostPool:
    """CPU scratch memory handed out as contiguous tensor views into large, reused slabs.

    Slabs of `slab_bytes` are allocated lazily, only when no free range fits, touched at once
    (so the machine check below sees them) and kept for the pool's life; a request larger
    than a slab gets its own slab (rounded up to 1 MiB), kept and reused too. Near the limit
    a new slab shrinks to the room left. `adopt` answers for memory the pool did not
    allocate (a CPU device's paged-out activations, which are host memory already): it
    counts as in use and against the limit, but takes no slab. Lasting allocations
    (`empty(..., lasting=True)`) take slabs of their own, of at most 8 MiB. Sizes are rounded
    up to 64 bytes and the byte counts reported (`in_use_bytes`, `peak_bytes`) are the
    rounded ones. Growing past `limit_bytes`,
    or so far that less than `reserve_fraction` of the machine's memory would stay free, raises
    HostMemoryError before anything is allocated; the pool stays usable. Thread safe.
    """

    def __init__(
        self,
        limit_bytes: int | str | None = None,
        *,
        slab_bytes: int = 64 << 20,
        pin: bool = False,
        reserve_fraction: float = 0.05,
    ) -> None:
        self._limit = parse_bytes(limit_bytes, "host_memory_limit")
        slab = parse_bytes(slab_bytes, "slab_bytes")
        assert slab is not None
        self._slab_bytes = _round_up(slab, ALIGN)
        if pin and not torch.cuda.is_available():
            raise ConfigError("pin=True needs CUDA (pinned host memory), but CUDA is not available")
        self._pin = bool(pin)
        if not 0.0 <= reserve_fraction < 1.0:
            raise ConfigError(f"reserve_fraction={reserve_fraction!r}: expected 0 <= value < 1")
        self._reserve_fraction = float(reserve_fraction)
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        self._live: dict[int, tuple[_Slab, int, int]] = {}  # data_ptr -> (slab, offset, size)
        self._in_use = 0
        self._peak = 0
        self._capacity = 0
        self._adopted = 0  # bytes answered for without a slab (see `adopt`)

    # -- allocation ---------------------------------------------------------------------

    def empty(
        self,
        shape: Sequence[int] | torch.Size,
        dtype: torch.dtype,
        *,
        what: str = "",
        lasting: bool = False,
    ) -> torch.Tensor:
        """An uninitialised contiguous tensor in the pool; give it back with `free`.

        `what` names the request in errors. `lasting`: it lives across steps (optimizer
        state, master weights) and takes slabs of its own, so state made mid-run never lands
        where scratch pages were freed and pushes the next step's pages into new slabs.
        Zero-element tensors take no pool memory and are not tracked (`free` accepts them as
        a no-op, `owns` says False).
        """
        shape = torch.Size(shape)
        if any(dim < 0 for dim in shape):
            raise ConfigError(f"empty(): negative dimension in shape {tuple(shape)} for {what!r}")
        nbytes = shape.numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = _round_up(nbytes, ALIGN)
        with self._lock:
            slab, offset = self._take(size, what or f"a {tuple(shape)} {dtype} tensor", lasting)
            view = slab.data[offset : offset + nbytes].view(dtype).view(shape)
            self._live[view.data_ptr()] = (slab, offset, size)
            self._in_use += size
            self._peak = max(self._peak, self._in_use)
        return view

    def free(self, tensor: torch.Tensor) -> None:
        """Return a tensor that `empty` handed out; its memory may be reused at once."""
        if tensor.numel() == 0:
            return
        ptr = tensor.data_ptr()
        with self._lock:
            entry = self._live.pop(ptr, None)
            if entry is None:
                raise MyelinError(self._not_live_reason(ptr))
            slab, offset, size = entry
            slab.give_back(offset, size)
            self._in_use -= size

    def adopt(self, nbytes: int, *, what: str = "") -> None:
        """Answer for `nbytes` of host memory held elsewhere (on a CPU device, a paged-out
        activation's own storage: copying host memory to host memory would free nothing).
        It counts as in use and, with the slabs, against the limit; `disown` gives it up.
        Raises HostMemoryError, having changed nothing, past the limit."""
        size = -(-nbytes // ALIGN) * ALIGN  # _round_up, inline: once per page
        with self._lock:
            if self._limit is not None and self._capacity + self._adopted + size > self._limit:
                raise HostMemoryError(
                    f"host memory pool limit reached: {what or 'adopted memory'} needs "
                    f"{human_bytes(size)}, {human_bytes(self._in_use)} is in use of "
                    f"{human_bytes(self._capacity)} in {len(self._slabs)} slabs and "
                    f"{human_bytes(self._adopted)} adopted, and the limit (host_memory_limit) "
                    f"is {human_bytes(self._limit)}; {_FIX_HINT}"
                )
            self._adopted += size
            self._in_use += size
            if self._in_use > self._peak:
                self._peak = self._in_use

    def disown(self, nbytes: int) -> None:
        """Stop answering for `nbytes` that `adopt` took on."""
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            if size > self._adopted:
                raise MyelinError(f"disown({nbytes}): only {human_bytes(self._adopted)} is adopted")
            self._adopted -= size
            self._in_use -= size

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a live allocation of this pool (one `free` would accept)."""
        if tensor.numel() == 0 or tensor.device.type != "cpu":
            return False
        with self._lock:
            return tensor.data_ptr() in self._live

    def reserve(self, nbytes: int) -> None:
        """Grow now, if needed, so that one free contiguous range holds `nbytes`: later
        allocations totalling up to `nbytes` (in 64-byte rounded sizes) need no new slab."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError(f"reserve({nbytes!r}): expected an int >= 0 bytes")
        if nbytes == 0:
            return
        size = _round_up(nbytes, ALIGN)
        with self._lock:
            if max((s.largest_free() for s in self._slabs if not s.lasting), default=0) < size:
                self._grow(size, f"reserve({human_bytes(nbytes)})")

    def reset_peak(self) -> None:
        """Start peak tracking over from the bytes in use now."""
        with self._lock:
            self._peak = self._in_use

    # -- numbers ------------------------------------------------------------------------

    @property
    def in_use_bytes(self) -> int:
        """Bytes handed out now, each allocation rounded up to 64 bytes."""
        return self._in_use

    @property
    def peak_bytes(self) -> int:
        """The most bytes in use at once since construction or `reset_peak`."""
        return self._peak

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all slabs together."""
        return self._capacity

    @property
    def limit_bytes(self) -> int | None:
        """The most `capacity_bytes` plus adopted bytes may reach; None means only the
        machine's memory limits it."""
        return self._limit

    @property
    def grows(self) -> int:
        """How many slabs were ever allocated; constant once the pool reaches a steady state."""
        return len(self._slabs)

    def stats(self) -> dict[str, int | None]:
        """The pool's numbers in one dict, for logs and reports."""
        with self._lock:
            return {
                "in_use_bytes": self._in_use,
                "peak_bytes": self._peak,
                "capacity_bytes": self._capacity,
                "adopted_bytes": self._adopted,
                "limit_bytes": self._limit,
                "slabs": len(self._slabs),
                "grows": len(self._slabs),
                "allocations": len(self._live),
            }

    def __repr__(self) -> str:
        limit = "none" if self._limit is None else human_bytes(self._limit)
        return (
            f"HostPool(in_use={human_bytes(self._in_use)}, capacity="
            f"{human_bytes(self._capacity)}, limit={limit}, slabs={len(self._slabs)})"
        )

    # -- internals (called with the lock held) -------------------------------------------

    def _take(self, size: int, what: str, lasting: bool = False) -> tuple[_Slab, int]:
        for slab in self._slabs:
            if slab.lasting == lasting:
                offset = slab.take(size)
                if offset is not None:
                    return slab, offset
        slab = self._grow(size, what, lasting)
        offset = slab.take(size)
        assert offset is not None
        return slab, offset

    def _grow(self, need: int, what: str, lasting: bool = False) -> _Slab:
        """Add a slab holding at least `need` bytes, or raise HostMemoryError having changed
        nothing. Near the limit the slab shrinks to the room left rather than failing."""
        slab_bytes = min(self._slab_bytes, _LASTING_SLAB) if lasting else self._slab_bytes
        target = slab_bytes if need <= slab_bytes else _round_up(need, _MIB)
        # torch's pinned allocator rounds every block up to a power of two: ask for that
        # (and count it), so the pool's figures and its limit are what is pinned
        block = pinned_block if self._pin else int
        target = block(target)
        if self._limit is not None:
            room = (self._limit - self._capacity - self._adopted) // ALIGN * ALIGN
            if block(need) > room:
                raise HostMemoryError(
                    f"host memory pool limit reached: {what} needs {human_bytes(need)}, "
                    f"{human_bytes(self._in_use)} is in use of {human_bytes(self._capacity)} "
                    f"in {len(self._slabs)} slabs, and the limit (host_memory_limit) is "
                    f"{human_bytes(self._limit)}; {_FIX_HINT}"
                )
            if target > room:
                target = 1 << (room.bit_length() - 1) if self._pin else room
        self._check_machine(target, what)
        try:
            data = torch.empty(target, dtype=torch.uint8, pin_memory=self._pin)
            if not self._pin:
                data.zero_()  # fault the pages in now: MemAvailable then counts them
        except RuntimeError as e:
            raise HostMemoryError(
                f"could not allocate a {human_bytes(target)} host slab for {what} "
                f"({human_bytes(self._capacity)} already in slabs): {e}; {_FIX_HINT}"
            ) from e
        slab = _Slab(data, [(0, target)], lasting)
        self._slabs.append(slab)
        self._capacity += target
        return slab

    def _check_machine(self, size: int, what: str) -> None:
        """Refuse a slab that would leave less than `reserve_fraction` of RAM free, so the
        pool never pushes the host into swap or the OOM killer."""
        info = _read_meminfo()
        available, total = info.get("MemAvailable"), info.get("MemTotal")
        if available is None or total is None:
            return
        keep = int(total * self._reserve_fraction)
        if available - size < keep:
            raise HostMemoryError(
                f"host is nearly out of memory: a {human_bytes(size)} slab for {what} would "
                f"leave {human_bytes(max(available - size, 0))} of {human_bytes(total)} free, "
                f"under the {self._reserve_fraction:.0%} kept in reserve; the pool holds "
                f"{human_bytes(self._capacity)} ({human_bytes(self._in_use)} in use). "
                "Free memory on this machine (fewer ranks or other processes per host), or "
                "lower microbatch size / turn off an offload"
            )

    def _not_live_reason(self, ptr: int) -> str:
        for slab in self._slabs:
            start = slab.data.data_ptr()
            if start <= ptr < start + slab.data.numel():
                return (
                    f"free(): the tensor at {ptr:#x} is inside this pool but not a live "
                    "allocation (freed twice, or a view that `empty` did not return)"
                )
        return f"free(): the tensor at {ptr:#x} was not allocated by this pool"
