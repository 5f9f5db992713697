"""Saved activations: account them, page them out to the host pool as the forward makes
them, bring them back ahead of backward.

Autograd keeps, per microbatch in flight, the tensors its backward will need. Under
`saving(mb)` every such tensor goes through a pack hook: parameters and small tensors
stay where they are; the storage behind a larger one becomes a page, tagged with the
layer that saved it (`watch` finds a module's layers; see layers.py). Backward needs the
pages in the reverse of the order the forward saved them last. As the forward goes on,
what it saved more than a window (`layers.Ahead`: about one layer's bytes) before its
latest page is copied, whole and once, into the host pool (on a GPU, on a side stream
while the forward goes on) and dropped from the device; the window itself, what backward
needs first, stays when the backward is next (one stage, the last stage) and leaves at
the end of the forward when it is not (a microbatch that waits in the pipeline).

In backward the unpack hook tells where backward is: when it reaches a page, the pages
the window holds below it start coming back, the nearest first, so the copy for layer i-1
runs while backward computes layer i; a page leaves the device once every view of it has
been unpacked and used. Backward gets back a view with the original offset and strides,
so its kernels, and results, are exactly those of training without offload.

`prefetch_ahead` starts bringing back the first pages of the next backwards (microbatches
that sit in the pipeline), `fetch` marks the start of a microbatch's backward, and
`release` frees what is left after it. On a machine without a GPU the "device" is host
memory too, so a page neither leaves nor comes back by a copy: the pool answers for its
bytes while it is out (pages.py), it is accounted as resident while it is back, and
backward gets the saved tensor itself. The hooks run per saved tensor, hundreds a step,
so their bookkeeping is kept to a few lookups: the windows are summed per layer, not per
tensor.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from myelin.offload.budget import DeviceBudget
from myelin.offload.layers import Ahead, find_layers
from myelin.offload.pages import Copier, Page, View
from myelin.offload.pool import HostPool
from myelin.offload.saved import ActivationStats, SavedMicrobatch

__all__ = ["ActivationStore", "ActivationStats"]

# A view is paged with its whole storage only if the storage is at most this many times
# bigger (q, k and v are each a third of one projection); a small view of a big buffer stays.
_MAX_STORAGE_RATIO = 4
_AGAIN = " after backward had used them all: retain_graph=True is not supported with offload"


def _weakly(store: ActivationStore) -> Any:
    """`store._used`, through a weak reference: the store holding its own bound method
    would be a cycle, keeping its host pool alive past close until a collection."""
    ref = weakref.ref(store)

    def on_used(used: _Used) -> None:
        alive = ref()
        if alive is not None:
            alive._used(used)

    return on_used


class _Used(weakref.ref):
    """A weak reference to a view backward unpacked, with its page (see `_used`)."""

    __slots__ = ("page",)
    page: Page


class ActivationStore:
    """Per-microbatch saved tensors of one stage: accounted, and paged out when asked.

    ahead: how far ahead of backward pages come back, and how much the forward keeps on
    the device behind it (layers.Ahead: one layer by default).
    """

    def __init__(
        self,
        device: torch.device,
        budget: DeviceBudget,
        *,
        pool: HostPool | None = None,
        min_bytes: int = 64 << 10,
        prefetch: int = 1,
        ahead: Ahead | None = None,
        persistent: Iterable[torch.Tensor] = (),
    ) -> None:
        self.device = torch.device(device)
        self.budget = budget
        self.pool = pool
        self.min_bytes = min_bytes
        self.depth = prefetch
        self.ahead = ahead if ahead is not None else Ahead()
        self.stats = ActivationStats()
        # Parameters and buffers: autograd saves them too, but they are never copied.
        self._persistent = {t.untyped_storage().data_ptr() for t in persistent}
        self._mbs: dict[int, SavedMicrobatch] = {}
        self._saving: SavedMicrobatch | None = None  # the microbatch whose forward runs
        self._hooks: list[Any] = []
        self._waits: list[tuple[int, float, float]] = []  # (mb, start, end), perf_counter
        self._unpacked: dict[int, _Used] = {}  # id -> a view backward holds, with its page
        self._copier = Copier(self.device)
        self._on_used = _weakly(self)  # made once: the unpack hook passes it per view

    @property
    def pages_out(self) -> bool:
        """Whether this store pages activations out (else it only accounts them)."""
        return self.pool is not None

    def watch(self, module: nn.Module) -> int:
        """Tag what autograd saves with the layer of `module` that saved it (forward hooks
        at each layer's start and end). Returns how many layers were found."""
        layers = find_layers(module)
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(self._boundary))
            self._hooks.append(layer.register_forward_hook(self._boundary))
        return len(layers)

    def close(self) -> None:
        """Take the layer hooks off the stage's modules (Trainer.close)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -- forward --------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(
        self, mb: int, keep: Iterable[torch.Tensor] = (), backward_next: bool = False
    ) -> Iterator[None]:
        """Run the forward of microbatch `mb` under hooks that account and page out what
        autograd saves. `keep`: tensors the stage holds anyway (its inputs), which copying
        would not free. `backward_next`: its backward runs right after, so its last layers
        stay on the device; otherwise every page leaves by the end of the forward."""
        entry = self._mbs.setdefault(mb, SavedMicrobatch())
        held = {t.untyped_storage().data_ptr() for t in keep}
        # storage pointer -> (a live tensor on it, its page): views of one storage share a
        # page. The tensor is held weakly and checked, as a freed address can be reused.
        paged: dict[int, tuple[Any, Page]] = {}
        paging = self.pool is not None
        persistent, min_bytes = self._persistent, self.min_bytes
        on_device = f"is_{self.device.type}"  # a Tensor property: is_cpu, is_cuda
        originals, moves = entry.originals, self._copier.moves
        doing = f"saving activations of microbatch {mb}"  # for errors: formatted once
        entry.fetching = f"bringing back activations of microbatch {mb}"

        def pack(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in persistent or not getattr(t, on_device):
                return t
            ref, page = paged.get(ptr, (None, None))
            if page is None or (page.device_copy is None and ref() is None):
                size = storage.nbytes()
                view = t.nbytes
                small = view < min_bytes or size > _MAX_STORAGE_RATIO * view
                if not paging or ptr in held or small:
                    return self._keep(entry, t, ptr, size, doing)
                page = Page(size, mb, entry.layer, entry.seq)
                self._hold(entry, page, storage, doing)
                entry.layer_bytes[entry.layer] += size
                entry.pages.append(page)
                originals.append(page)
                entry.held += size
                base = t if t._base is None else t._base  # lives as long as the storage's owner
                paged[ptr] = (weakref.ref(base), page)
            elif page is not entry.pages[-1] or page.layer != entry.layer:
                self._touch(entry, page, storage)  # saved again: backward needs it later
            entry.seq += 1
            page.views += 1
            if len(originals) > 1:
                self._trim(entry)
            if moves:
                return View(page, t.dtype, t.shape, t.stride(), t.storage_offset())
            # The page never moves: keep the tensor itself, detached (autograd's graph holding
            # a node's own output would be a reference cycle). A plain tuple: made per tensor.
            return (page, t.detach())

        persistent, kept, kind, budget = self._persistent, entry.kept, self.device.type, self.budget

        def account(t: torch.Tensor) -> Any:
            """`pack` when nothing is paged out (every tensor kept): `_keep` inlined, as it
            runs for every tensor autograd saves."""
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in persistent and ptr not in kept and t.device.type == kind:
                size = storage.nbytes()
                budget.add("activations", size, doing)  # (as _grow)
                entry.resident += size
                kept[ptr] = size
            return t.detach()  # (as in _keep)

        self._saving = entry
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                pack if paging else account, self._unpack
            ):
                yield
            while entry.originals and not backward_next:
                self._copy_out(entry, entry.originals.popleft())
            self.stats.layers = entry.layer + 1
            self.stats.resident_step_bytes += sum(p.nbytes for p in entry.originals)
            entry.cursor = len(entry.pages)
            for i, page in enumerate(entry.pages):
                page.index = i
            entry.reach = self.ahead.reach(entry.pages, entry.layer_bytes)
        finally:
            self._saving = None

    def _touch(self, entry: SavedMicrobatch, page: Page, storage: torch.UntypedStorage) -> None:
        """`page` is saved again, by a later layer: backward needs it first there. If it left
        the device already, the forward still holds its storage: keep that, no round trip."""
        entry.pages.remove(page)
        entry.pages.append(page)
        entry.layer_bytes[page.layer] -= page.nbytes
        entry.layer_bytes[entry.layer] += page.nbytes
        entry.window_at = -1  # an earlier layer's bytes changed
        page.layer, page.seq = entry.layer, entry.seq
        if page.device_copy is None:
            self._hold(entry, page, storage, f"saving activations of microbatch {page.mb}")
            entry.held += page.nbytes
        else:
            entry.originals.remove(page)
        entry.originals.append(page)

    def _boundary(self, *_: Any) -> None:
        """A layer starts or ends: what the forward saves from now on is the next layer's."""
        entry = self._saving
        if entry is not None and entry.layer_bytes[entry.layer]:  # else the layer goes on
            entry.layer += 1
            entry.layer_bytes.append(0)

    def _trim(self, entry: SavedMicrobatch) -> None:
        """Page out the oldest of what the forward holds until what is left below its last
        page fits the window backward will want there (at least one page, unless none)."""
        originals = entry.originals
        if entry.window_at != entry.layer:
            entry.window = self.ahead.window(entry.layer_bytes, entry.layer)
            entry.window_at = entry.layer or -1
        window = entry.window
        while len(originals) > 1:
            below = entry.held - originals[-1].nbytes
            if below <= window or (window and len(originals) == 2):
                return
            self._copy_out(entry, originals.popleft())

    def _copy_out(self, entry: SavedMicrobatch, page: Page) -> None:
        """Copy `page` to the host pool (unless it is there already) and drop it from the
        device."""
        assert self.pool is not None and page.device_copy is not None
        if page.host is None:
            self._copier.copy_out(page, self.pool)
            self.stats.offloaded_bytes += page.nbytes
            self.stats.offloaded_step_bytes += page.nbytes
            self.stats.pages += 1
        entry.held -= page.nbytes
        self._drop(entry, page)

    def _keep(
        self, entry: SavedMicrobatch, t: torch.Tensor, ptr: int, size: int, doing: str
    ) -> torch.Tensor:
        """Account `t`'s storage (`size` bytes at `ptr`) once; it stays where it is.
        Returned detached: a node's saved output with its grad_fn would be a reference cycle
        through autograd's graph, which no garbage collection frees if backward never runs."""
        if ptr not in entry.kept:
            self._grow(entry, size, doing)
            entry.kept[ptr] = size
        return t.detach()

    def _grow(self, entry: SavedMicrobatch, nbytes: int, doing: str) -> None:
        self.budget.add("activations", nbytes, doing)
        entry.resident += nbytes

    def _hold(
        self, entry: SavedMicrobatch, page: Page, storage: torch.UntypedStorage, doing: str
    ) -> None:
        """Keep the forward's own storage as `page` on the device (accounted, checked)."""
        self._grow(entry, page.nbytes, doing)
        page.device_copy, page.original = self._copier.own(storage), True

    def _drop(self, entry: SavedMicrobatch, page: Page) -> None:
        """Take `page` off the device (no longer accounted)."""
        if page.device_copy is not None:
            page.device_copy, page.original = None, False
            self.budget.add("activations", -page.nbytes, "")
            entry.resident -= page.nbytes

    # -- backward -------------------------------------------------------------------------

    def prefetch_ahead(self) -> int:
        """Start bringing back the first pages of the next `prefetch` microbatches whose
        backward comes next (the oldest in flight: every schedule runs backwards oldest
        first). Returns the bytes it started to copy."""
        waiting = [
            entry
            for _, entry in sorted(self._mbs.items())
            if entry.position is None and entry is not self._saving
        ]
        started = 0
        for entry in waiting[: self.depth]:
            if entry.pages and entry.reach is not None:
                low = entry.reach.lowest(len(entry.pages) - 1)
                started += self._bring_back(entry, low, len(entry.pages))
        return started

    def fetch(self, mb: int) -> None:
        """The backward of `mb` starts: bring back what it needs first, waiting for it if
        it must (time backward waited), and start the copies of what comes next."""
        entry = self._mbs.get(mb)
        if entry is None or entry.position is not None or not entry.pages:
            return  # nothing paged, or asked again
        start = time.perf_counter()
        self._advance(entry, len(entry.pages) - 1)
        self._need(entry.pages[-1], start)

    def _advance(self, entry: SavedMicrobatch, pos: int) -> None:
        """Backward is at `entry.pages[pos]`: bring back what it needs there, and start the
        copies of what it needs next."""
        entry.position = pos
        assert entry.reach is not None  # set when its forward ended
        low = entry.reach.lowest(pos)
        if low < entry.cursor:
            self._bring_back(entry, low, pos)

    def _bring_back(self, entry: SavedMicrobatch, low: int, now: int) -> int:
        """Start copying back the pages from index `low` up that are off the device and
        not used up; those below `now` come early. Returns their bytes."""
        nbytes = 0
        for page in reversed(entry.pages[low : entry.cursor]):  # the one needed soonest first
            if page.device_copy is None and not page.unpacked:
                self._copy_in(entry, page, early=page.index < now)
                nbytes += page.nbytes
        entry.cursor = min(entry.cursor, low)
        self.stats.fetched_step_bytes += nbytes
        return nbytes

    def _copy_in(self, entry: SavedMicrobatch, page: Page, early: bool) -> None:
        self._grow(entry, page.nbytes, entry.fetching)
        page.device_copy, page.original = self._copier.copy_in(page), False
        page.early = early

    def _need(self, page: Page, start: float) -> None:
        """Backward needs `page` now (it asked at `start`): count a hit or a miss, once.
        A page not back yet is waited for by the compute stream (`Copier.view`), not the
        host, which keeps its lead over the GPU; the host time of a miss is its wait."""
        if page.original or (page.counted and page.device_copy is not None):
            return  # the forward's own storage, or counted already and still here
        if page.device_copy is None:  # not brought back: a schedule this store did not foresee
            if page.host is None:  # used up: its host memory went back to the pool
                raise RuntimeError(f"activations of microbatch {page.mb} were needed again{_AGAIN}")
            self._copy_in(self._mbs[page.mb], page, early=False)
            self.stats.fetched_step_bytes += page.nbytes
        done = self._copier.done(page)
        if page.early and done and not page.counted:
            self.stats.prefetch_hits += 1
        else:
            if not page.counted:
                self.stats.prefetch_misses += 1
            end = time.perf_counter()
            self.stats.wait_s += end - start
            self._waits.append((page.mb, start, end))
        page.counted = True

    def _unpack(self, packed: Any) -> torch.Tensor:
        kind = type(packed)
        if kind is not tuple and kind is not View:
            return packed  # kept where it was
        page = packed[0]  # a View, or (page, the saved tensor itself) where pages never move
        entry = self._mbs.get(page.mb)
        if page.freed or entry is None:  # unpacked after its microbatch was released
            raise RuntimeError(
                f"activations of microbatch {page.mb} were needed after its backward ended"
            )
        start = time.perf_counter()
        if page.index >= 0 and (entry.position is None or page.index < entry.position):
            self._advance(entry, page.index)  # (index -1: a backward inside the forward)
        if not (page.original or (page.counted and page.device_copy is not None)):
            self._need(page, start)  # (else: the forward's own storage, or back and counted)
        out = packed[1] if kind is tuple else self._copier.view(packed)
        if page.index >= 0:  # the microbatch's own backward; a set: a tensor read twice
            page.used.add(id(packed))  # (ctx.saved_tensors) counts once
        page.alive += 1
        ref = _Used(out, self._on_used)
        ref.page = page
        self._unpacked[id(ref)] = ref  # by id: a weakref hashes as its tensor, in Python
        return out

    def _used(self, ref: _Used) -> None:
        """An unpacked view died; once backward has unpacked every saved tensor on its page
        (each counted once, however often it is read) and no view of it is alive, drop the
        page from the device and give its host memory back (on a CPU that frees the storage
        as backward goes, as autograd would, rather than at the end of the microbatch's
        backward; a second backward over the same graph is then an error that says so)."""
        page = self._unpacked.pop(id(ref)).page
        page.alive -= 1
        if page.alive or page.unpacked < page.views or page.freed:
            return
        entry = self._mbs.get(page.mb)
        if entry is not None:
            self._drop(entry, page)
            if self.pool is not None:
                self._copier.free(page, self.pool)

    def take_waits(self) -> list[tuple[int, float, float]]:
        """The waits for pages since the last call: (microbatch, start, end) on the
        time.perf_counter clock, for the profiler."""
        waits, self._waits = self._waits, []
        return waits

    def release(self, mb: int) -> None:
        """Forget microbatch `mb` after its backward: free its pages and its accounting."""
        entry = self._mbs.pop(mb, None)
        if entry is None:
            return
        for page in entry.pages:
            page.freed = True
            page.device_copy = None
            if self.pool is not None:
                self._copier.free(page, self.pool)
        self.budget.add("activations", -entry.resident, "")

    def begin_step(self) -> None:
        if self.pool is not None:
            self._copier.reap(self.pool)  # pages used up last step, their copies landed since
        self.stats.offloaded_step_bytes = 0
        self.stats.fetched_step_bytes = 0
        self.stats.resident_step_bytes = 0

    def clear(self) -> None:
        """Drop every microbatch (after a failed step)."""
        self._saving = None
        self._waits.clear()
        for mb in list(self._mbs):
            self.release(mb)
