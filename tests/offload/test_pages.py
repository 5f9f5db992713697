"""A page's host memory goes back to the pool only once its last copy has read it
(myelin/offload/pages.py). On a GPU backward waits for a page's copy on the device, not on
the host, so a page can be used up while its copy back is still queued; its memory must not
be handed to anything else meanwhile. The copy's event is stood in for here: on a CPU pages
are never copied."""

from __future__ import annotations

import torch

from myelin.offload.pages import Copier, Page
from myelin.offload.pool import HostPool


class _Event:
    """A CUDA event's `query`, set by the test."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _paged(copier: Copier, pool: HostPool, nbytes: int = 4096) -> Page:
    page = Page(nbytes=nbytes, mb=0, layer=0, seq=0)
    page.host = pool.empty((nbytes,), torch.uint8, what="a test page")
    page.ready = _Event()
    return page


def test_a_page_used_up_before_its_copy_landed_is_freed_once_it_has():
    pool = HostPool(slab_bytes=1 << 16)
    copier = Copier(torch.device("cpu"))
    copier._stream = object()  # as on a GPU: pages are copied on a side stream
    first, second = _paged(copier, pool), _paged(copier, pool)
    copier.free(first, pool)
    copier.free(second, pool)
    assert first.host is None and pool.in_use_bytes == 8192  # both copies still queued
    first.ready.done = True
    copier.reap(pool)
    assert pool.in_use_bytes == 4096  # the first is back; the second's copy still reads
    second.ready.done = True
    done = _paged(copier, pool)
    done.ready.done = True
    copier.free(done, pool)  # landed already: back at once, and the second with it
    assert pool.in_use_bytes == 0
