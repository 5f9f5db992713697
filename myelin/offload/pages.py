"""Pages of saved activations, and the copies that move them between the device and the
host pool.

A page is one storage autograd saved for backward, whole: several saved tensors (q, k and
v, views of one projection) can be views of it. `Copier` moves pages: on a GPU every copy
runs on one side stream, after what the compute stream has queued, and records an event
that whoever uses the copy waits for. On a CPU the device is host memory already: a copy
would free nothing, so paging out hands the page's own storage to the pool, which answers
for its bytes (`HostPool.adopt`), and a page comes back as that storage, without a copy
either way (as torch's `save_on_cpu` does on a CPU); a saved tensor is then kept as itself,
not rebuilt over its page in backward (`View`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from myelin.offload.pool import HostPool

__all__ = ["Copier", "Page", "View", "bytes_of"]


@dataclass(slots=True, eq=False)
class Page:
    """One storage that autograd saved: on the device (the forward's own or a copy back),
    in the host pool (once paged out), or both."""

    nbytes: int
    mb: int
    layer: int  # the last layer that saved it: where backward first needs it
    seq: int  # when the forward last saved it: backward needs pages in reverse order
    index: int = -1  # its place in that order, once the forward is done
    # On the device, accounted while set: uint8 over the forward's storage or a copy back; on
    # a CPU the forward's UntypedStorage itself (`Copier.own`).
    device_copy: torch.Tensor | torch.UntypedStorage | None = None
    original: bool = False  # device_copy is the forward's own storage, never copied back
    # Once paged out: uint8 in the pool; on a CPU the same storage, adopted by the pool.
    host: torch.Tensor | torch.UntypedStorage | None = None
    ready: Any = None  # a CUDA event: the page's last copy is done
    early: bool = False  # brought back before backward needed it
    counted: bool = False  # counted as a hit or a miss
    views: int = 0  # saved tensors that are views of it
    used: set[int] = field(default_factory=set)  # id() of each that backward has unpacked
    alive: int = 0  # unpacked views still alive
    freed: bool = False  # its microbatch was released

    @property
    def unpacked(self) -> int:
        """Saved tensors on it that backward has unpacked, each once however often read."""
        return len(self.used)


class View(NamedTuple):
    """A saved tensor as a view of a page, rebuilt over its device copy in backward."""

    page: Page
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class Copier:
    """Copies pages out to the host pool and back, on a side stream on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        self.moves = cuda  # whether pages are copied (else saved tensors are kept as they are)
        self._deferred: list[tuple[Any, torch.Tensor]] = []  # (copy's event, host memory)

    def own(self, storage: torch.UntypedStorage) -> torch.Tensor | torch.UntypedStorage:
        """The forward's own `storage` as a page's device copy: on a GPU uint8 over it, which
        the page-out copy reads; on a CPU the storage itself (nothing reads it)."""
        return bytes_of(storage) if self._stream is not None else storage

    def copy_out(self, page: Page, pool: HostPool) -> None:
        """Start copying the page's device bytes into new pool memory (`page.host`)."""
        src = page.device_copy
        assert src is not None
        what = f"activations of microbatch {page.mb}"
        if self._stream is None:  # host and device are one memory: adopt, do not copy
            pool.adopt(page.nbytes, what=what)
            page.host = src
            return
        page.host = pool.empty((page.nbytes,), torch.uint8, what=what)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            page.host.copy_(src, non_blocking=True)
            src.record_stream(self._stream)  # its memory is not reused before the copy
            page.ready = torch.cuda.Event()
            page.ready.record(self._stream)

    def copy_in(self, page: Page) -> torch.Tensor | torch.UntypedStorage:
        """Start bringing the page back from the pool; the device copy (on a CPU, the
        adopted storage itself)."""
        assert page.host is not None
        if self._stream is None:  # host and device are one memory: a view, no copy
            return page.host
        with torch.cuda.stream(self._stream):
            if page.ready is not None:
                self._stream.wait_event(page.ready)  # its page-out has landed
            dev = torch.empty(page.nbytes, dtype=torch.uint8, device=self.device)
            dev.copy_(page.host, non_blocking=True)
            page.ready = torch.cuda.Event()
            page.ready.record(self._stream)
        return dev

    def free(self, page: Page, pool: HostPool) -> None:
        """Give the page's host memory back to the pool; on a GPU once its last copy has
        read it (backward waits for a copy on the device, not the host, so a page can be
        used up while its copy back is still queued)."""
        if page.host is None:
            return
        if self._stream is None:
            pool.disown(page.nbytes)
        elif not self.done(page):
            self._deferred.append((page.ready, page.host))
        else:
            pool.free(page.host)
        page.host = None
        self.reap(pool)

    def reap(self, pool: HostPool) -> None:
        """Give back the host memory of pages whose last copy has finished since."""
        while self._deferred and self._deferred[0][0].query():
            pool.free(self._deferred.pop(0)[1])

    @staticmethod
    def done(page: Page) -> bool:
        """Whether the page's last copy has finished."""
        return page.ready is None or page.ready.query()

    def view(self, saved: View) -> torch.Tensor:
        """The saved tensor rebuilt over its page's device copy, with its offset and strides;
        on a GPU the compute stream waits for the copy first."""
        page = saved.page
        copy = page.device_copy  # uint8: the forward's storage, a copy back, or pool memory
        assert isinstance(copy, torch.Tensor)
        if page.ready is not None and not page.original:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(page.ready)
            copy.record_stream(current)
        offset = copy.storage_offset() // saved.dtype.itemsize + saved.offset
        out = torch.empty(0, dtype=saved.dtype, device=self.device)
        return out.set_(copy.untyped_storage(), offset, saved.size, saved.stride)


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))
