"""Saved activations: account them, page them out to the host pool, bring them back.

Autograd keeps, per microbatch in flight, the tensors its backward will need. Under
`saving(mb)` every such tensor goes through a pack hook: parameters and small tensors
stay where they are; the storage behind a larger one is copied, whole and once, into
the host pool (on a GPU, on a side stream while the forward goes on) and the device
copy is dropped. Backward gets back a view with the original offset and strides, so
its kernels, and results, are exactly those of training without offload.

`prefetch_ahead` starts bringing back the pages of the next backwards, `fetch` makes
sure all of a microbatch's pages are back when its backward starts, and `release`
frees them after it. On a machine without a GPU the "device" is host memory too, so a
page comes back as a view of its pool memory (still accounted as resident), not a copy.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from myelin.offload.budget import DeviceBudget
from myelin.offload.pool import HostPool

__all__ = ["ActivationStore", "ActivationStats"]

# A view is paged with its whole storage only if the storage is at most this many times
# bigger (q, k and v are each a third of one projection); a small view of a big buffer stays.
_MAX_STORAGE_RATIO = 4


@dataclass(slots=True)
class ActivationStats:
    """Counters over the life of a store (`offloaded_step_bytes`: the last step only)."""

    offloaded_bytes: int = 0  # paged out since the start
    offloaded_step_bytes: int = 0
    pages: int = 0
    prefetch_hits: int = 0  # pages already back when backward needed them
    prefetch_misses: int = 0  # pages backward had to wait for
    wait_s: float = 0.0  # time backward waited for pages


@dataclass(slots=True, eq=False)
class _Page:
    """One paged-out storage: its bytes in the host pool and, once fetched, on the device."""

    host: torch.Tensor  # uint8, in the pool
    nbytes: int
    mb: int
    device_copy: torch.Tensor | None = None  # uint8, on the device
    ready: Any = None  # a CUDA event: the page's last copy is done
    early: bool = False  # fetched by `prefetch_ahead` rather than at backward


@dataclass(slots=True, frozen=True)
class _View:
    """A saved tensor as a view of a page."""

    page: _Page
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(slots=True)
class _Microbatch:
    pages: list[_Page] = field(default_factory=list)
    kept: dict[int, int] = field(default_factory=dict)  # storage pointer -> bytes on device
    resident: int = 0  # bytes this microbatch holds on the device
    fetched: bool = False  # its backward has started: every page is back


class ActivationStore:
    """Per-microbatch saved tensors of one stage: accounted, and paged out when asked."""

    def __init__(
        self,
        device: torch.device,
        budget: DeviceBudget,
        *,
        pool: HostPool | None = None,
        min_bytes: int = 64 << 10,
        prefetch: int = 1,
        persistent: Iterable[torch.Tensor] = (),
    ) -> None:
        self.device = torch.device(device)
        self.budget = budget
        self.pool = pool
        self.min_bytes = min_bytes
        self.depth = prefetch
        self.stats = ActivationStats()
        # Parameters and buffers: autograd saves them too, but they are never copied.
        self._persistent = {t.untyped_storage().data_ptr() for t in persistent}
        self._mbs: dict[int, _Microbatch] = {}
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    @property
    def pages_out(self) -> bool:
        """Whether this store pages activations out (else it only accounts them)."""
        return self.pool is not None

    # -- forward --------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(
        self, mb: int, keep: Iterable[torch.Tensor] = (), page_out: bool = True
    ) -> Iterator[None]:
        """Run the forward of microbatch `mb` under hooks that account (and, with
        `page_out`, page out) what autograd saves. `keep`: tensors the stage holds
        anyway (its inputs), which copying would not free."""
        entry = self._mbs.setdefault(mb, _Microbatch())
        held = {t.untyped_storage().data_ptr() for t in keep}
        # storage pointer -> (a live tensor on it, its page): views of one storage share a
        # page. The tensor is held weakly and checked, as a freed address can be reused.
        paged: dict[int, tuple[Any, _Page]] = {}
        paging = page_out and self.pool is not None

        def pack(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self._persistent or t.device.type != self.device.type:
                return t
            ref, page = paged.get(ptr, (None, None))
            if page is None or ref() is None:
                size = storage.nbytes()
                view = t.numel() * t.element_size()
                if not paging or ptr in held or view < self.min_bytes:
                    return self._keep(entry, t, ptr, mb)
                if size > _MAX_STORAGE_RATIO * view:
                    return self._keep(entry, t, ptr, mb)
                page = self._page_out(storage, size, mb)
                entry.pages.append(page)
                base = t if t._base is None else t._base  # lives as long as the storage's owner
                paged[ptr] = (weakref.ref(base), page)
            return _View(page, t.dtype, t.shape, t.stride(), t.storage_offset())

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _keep(self, entry: _Microbatch, t: torch.Tensor, ptr: int, mb: int) -> torch.Tensor:
        if ptr not in entry.kept:
            size = t.untyped_storage().nbytes()
            self._grow(entry, size, f"saving activations of microbatch {mb}")
            entry.kept[ptr] = size
        return t

    def _grow(self, entry: _Microbatch, nbytes: int, doing: str) -> None:
        self.budget.add("activations", nbytes, doing)
        entry.resident += nbytes

    def _page_out(self, storage: torch.UntypedStorage, nbytes: int, mb: int) -> _Page:
        assert self.pool is not None
        host = self.pool.empty((nbytes,), torch.uint8, what=f"activations of microbatch {mb}")
        src = _bytes_of(storage)
        page = _Page(host, nbytes, mb)
        if self._stream is None:
            host.copy_(src)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host.copy_(src, non_blocking=True)
                src.record_stream(self._stream)
                page.ready = torch.cuda.Event()
                page.ready.record(self._stream)
        self.stats.offloaded_bytes += nbytes
        self.stats.offloaded_step_bytes += nbytes
        self.stats.pages += 1
        return page

    # -- backward -------------------------------------------------------------------------

    def prefetch_ahead(self) -> int:
        """Start bringing back the pages of the next `prefetch` microbatches whose backward
        comes next (the oldest in flight: every schedule runs backwards oldest first).
        Returns the bytes it started to copy."""
        waiting = [mb for mb in sorted(self._mbs) if self._mbs[mb].pages]
        return sum(self._fetch(mb, early=True) for mb in waiting[: self.depth])

    def fetch(self, mb: int) -> None:
        """Bring back whatever of `mb` is still out, now that its backward starts; the time
        this takes is time backward waited."""
        entry = self._mbs.get(mb)
        if entry is None or not entry.pages or entry.fetched:
            return
        entry.fetched = True  # counted once, however often it is asked
        start = time.perf_counter()
        self._fetch(mb, early=False)
        for page in entry.pages:
            if page.early and (page.ready is None or page.ready.query()):
                self.stats.prefetch_hits += 1
                continue
            self.stats.prefetch_misses += 1
            if page.ready is not None:
                page.ready.synchronize()
        self.stats.wait_s += time.perf_counter() - start

    def _fetch(self, mb: int, early: bool) -> int:
        entry = self._mbs[mb]
        todo = [p for p in entry.pages if p.device_copy is None]
        if not todo:
            return 0
        nbytes = sum(p.nbytes for p in todo)
        self._grow(entry, nbytes, f"bringing back microbatch {mb}")
        for page in todo:
            page.early = early
            if self._stream is None:  # host and device are one memory: a view, no copy
                page.device_copy = page.host
                continue
            with torch.cuda.stream(self._stream):
                if page.ready is not None:
                    self._stream.wait_event(page.ready)
                dev = torch.empty(page.nbytes, dtype=torch.uint8, device=self.device)
                dev.copy_(page.host, non_blocking=True)
                page.device_copy = dev
                page.ready = torch.cuda.Event()
                page.ready.record(self._stream)
        return nbytes

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        view: _View = packed
        page = view.page
        if page.device_copy is None:  # not fetched: a schedule this store did not foresee
            start = time.perf_counter()
            if page.ready is not None:
                page.ready.synchronize()  # the page-out copy must have landed first
                page.ready = None
            entry = self._mbs[page.mb]
            self._grow(entry, page.nbytes, f"bringing back microbatch {page.mb}")
            page.device_copy = page.host.to(self.device, copy=True)
            self.stats.prefetch_misses += 1
            self.stats.wait_s += time.perf_counter() - start
        if page.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(page.ready)
            page.device_copy.record_stream(current)
        copy = page.device_copy  # uint8, perhaps a view into a pool slab
        offset = copy.storage_offset() // view.dtype.itemsize + view.offset
        out = torch.empty(0, dtype=view.dtype, device=self.device)
        return out.set_(copy.untyped_storage(), offset, view.size, view.stride)

    def release(self, mb: int) -> None:
        """Forget microbatch `mb` after its backward: free its pages and its accounting."""
        entry = self._mbs.pop(mb, None)
        if entry is None:
            return
        for page in entry.pages:
            # On a GPU the host page's last use is on the side stream, which any later use
            # of the same memory also runs on, so it can be reused at once.
            self.pool.free(page.host)
            page.device_copy = None
        self.budget.add("activations", -entry.resident, "")

    def begin_step(self) -> None:
        self.stats.offloaded_step_bytes = 0

    def clear(self) -> None:
        """Drop every microbatch (after a failed step)."""
        for mb in list(self._mbs):
            self.release(mb)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))
