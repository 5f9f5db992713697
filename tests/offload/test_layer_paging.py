"""One microbatch paged layer by layer: as the forward goes, out to the host pool; in
backward, back in reverse order ahead of where backward is; the last layer stays.

Run: python -m pytest -q tests/offload/test_layer_paging.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from myelin.models import GPT, GPTConfig, lm_loss
from myelin.offload.activations import ActivationStore
from myelin.offload.budget import DeviceBudget
from myelin.offload.layers import Ahead
from myelin.offload.pool import HostPool

CPU = torch.device("cpu")
CFG = GPTConfig(vocab_size=64, block_size=64, n_layer=6, n_head=2, d_model=32)

pytestmark = pytest.mark.usefixtures("one_thread", "roomy_machine")


class Trace(DeviceBudget):
    """A device budget that remembers the accounted activations after every change."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.activations: list[int] = []

    def add(self, category: str, nbytes: int, doing: str) -> None:
        super().add(category, nbytes, doing)
        self.activations.append(self.resident["activations"])


def gpt_and_batch(seed: int = 1) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    return GPT(CFG), x[:, :-1], x[:, 1:]


def watched_store(model: nn.Module, **kw) -> ActivationStore:
    persistent = [*model.parameters(), *model.buffers()]
    budget = kw.pop("budget", None) or Trace()
    pool = HostPool(slab_bytes=1 << 20)
    store = ActivationStore(CPU, budget, pool=pool, min_bytes=0, persistent=persistent, **kw)
    store.watch(model)
    return store


def plain_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def paged_grads(model, x, y, store, backward_next=True, during=None) -> list[torch.Tensor]:
    """One microbatch as the loop runs it when backward follows at once."""
    model.zero_grad(set_to_none=True)
    with store.saving(0, keep=[x], backward_next=backward_next):
        loss = lm_loss(model(x), y)
    if during is not None:
        during()
    store.fetch(0)
    loss.backward()
    store.release(0)
    return [p.grad.clone() for p in model.parameters()]


def test_one_microbatch_pages_out_and_back_with_identical_gradients():
    model, x, y = gpt_and_batch()
    expected = plain_grads(model, x, y)
    store = watched_store(model)
    got = paged_grads(model, x, y, store)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    stats = store.stats
    assert stats.layers == CFG.n_layer + 2  # the embedding, the blocks, the head and loss
    assert stats.offloaded_step_bytes > 0  # before: nothing, as backward was next
    # Everything that left came back, once, ahead of where backward was.
    assert stats.fetched_step_bytes == stats.offloaded_step_bytes
    assert stats.prefetch_misses == 0 and stats.prefetch_hits == stats.pages
    # What backward needs first never left.
    assert stats.resident_step_bytes > 0
    assert store.pool.in_use_bytes == 0 and store.budget.resident["activations"] == 0


def test_the_device_holds_about_one_layer_at_a_time():
    model, x, y = gpt_and_batch()
    kept = watched_store(model, ahead=Ahead(nbytes=1 << 40))  # keeps all: the old peak
    paged_grads(model, x, y, kept)
    everything = max(kept.budget.activations)
    assert kept.stats.offloaded_step_bytes == 0
    store = watched_store(model)
    paged_grads(model, x, y, store)
    peak = max(store.budget.activations)
    one_block = everything / (CFG.n_layer + 1)  # about one layer's saved bytes
    assert peak < 2.2 * one_block, (peak, one_block)
    assert peak < everything / 3


@pytest.mark.parametrize("ahead", [Ahead(layers=0), Ahead(layers=1), Ahead(layers=2),
                                   Ahead(nbytes=160 << 10)])  # fmt: skip
def test_pages_come_back_in_reverse_order_as_far_ahead_as_asked(ahead, monkeypatch):
    model, x, y = gpt_and_batch()
    store = watched_store(model, ahead=ahead)
    order: list[tuple[int, int]] = []  # (index, where backward was) of each page brought back
    copy_in = ActivationStore._copy_in

    def logged(self, entry, page, early):
        order.append((page.index, entry.position))
        copy_in(self, entry, page, early)

    monkeypatch.setattr(ActivationStore, "_copy_in", logged)
    expected = plain_grads(model, x, y)
    got = paged_grads(model, x, y, store)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert len(order) == store.stats.pages > 0
    if ahead.layers == 0 and ahead.nbytes is None:  # brought back only when needed
        assert all(i >= at for i, at in order), order
        assert store.stats.prefetch_misses == store.stats.pages
    else:
        indices = [i for i, _ in order]
        assert indices == sorted(indices, reverse=True)
        assert all(i < at for i, at in order), order  # always before backward got there
        assert store.stats.prefetch_hits == store.stats.pages


def test_more_ahead_holds_more():
    model, x, y = gpt_and_batch()
    peaks = []
    for ahead in (Ahead(layers=0), Ahead(layers=1), Ahead(layers=3)):
        store = watched_store(model, ahead=ahead)
        paged_grads(model, x, y, store)
        peaks.append(max(store.budget.activations))
    assert peaks[0] < peaks[1] < peaks[2]


def test_accounting_counts_what_is_on_the_device_and_nothing_else():
    """Paged-out pages do not count, pages back (or never gone) do, and a page leaves the
    count once backward has used every view of it."""
    model, x, y = gpt_and_batch()
    store = watched_store(model)
    checks = []

    def check() -> None:
        entry = store._mbs[0]
        on_device = sum(p.nbytes for p in entry.pages if p.device_copy is not None)
        assert store.budget.resident["activations"] == on_device + sum(entry.kept.values())
        assert store.pool.in_use_bytes == sum(p.nbytes for p in entry.pages if p.host is not None)
        used = [p for p in entry.pages if p.unpacked == p.views and not p.alive]
        assert all(p.device_copy is None for p in used)
        checks.append(len(used))

    def hook(grad: torch.Tensor) -> None:
        check()

    model.zero_grad(set_to_none=True)
    with store.saving(0, keep=[x], backward_next=True):
        h = model.embed(x)
        for block in model.blocks:
            h = block(h)
            h.register_hook(hook)
        loss = lm_loss(model.head(h), y)
    check()
    store.fetch(0)
    loss.backward()
    assert checks[0] == 0 and checks[-1] > 0  # pages used up as backward went
    store.release(0)
    assert store.budget.resident["activations"] == 0 and store.pool.in_use_bytes == 0


def test_a_storage_saved_by_two_layers_is_one_page():
    """Each block's tanh saves its output, which the next block's linear saves as input."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)))
    x = torch.randn(256, 64, requires_grad=True)
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    store = watched_store(model)
    with store.saving(0, keep=[x], backward_next=True):
        loss = model(x).pow(2).mean()
    entry = store._mbs[0]
    assert len(entry.pages) == 6  # the tanh outputs, each once
    assert [p.layer for p in entry.pages] == [1, 2, 3, 4, 5, 6]  # needed first by the next (loss)
    store.fetch(0)
    loss.backward()
    store.release(0)
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    page = 256 * 64 * 4
    assert store.stats.offloaded_step_bytes == store.stats.pages * page  # none copied twice


def test_a_microbatch_whose_backward_waits_pages_everything_out():
    model, x, y = gpt_and_batch()
    store = watched_store(model)
    seen = {}

    def before_backward() -> None:
        seen["resident"] = store.budget.resident["activations"]
        seen["kept"] = sum(store._mbs[0].kept.values())

    expected = plain_grads(model, x, y)
    got = paged_grads(model, x, y, store, backward_next=False, during=before_backward)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert seen["resident"] == seen["kept"]  # only what is never paged
    assert store.stats.resident_step_bytes == 0
    # Its backward misses only the page it needs first; the rest comes ahead.
    assert store.stats.prefetch_misses == 1


class _Exp(nn.Module):
    """Layer 0: y = exp(x), z = exp(y), each saving its output (S bytes each)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.exp()
        return y, y.exp()


class _Again(nn.Module):
    """Layer 1: a new page exp(z), then y saved again (by a product with a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, yz: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y, z = yz
        return z.exp().sum() + (y * self.w).sum()


def test_a_page_saved_again_shrinks_the_window_of_the_layer_that_took_it():
    """The forward's window (the bytes of the layers below) is summed once per layer and
    kept; y saved again in layer 1 moves its bytes out of layer 0, so the window shrinks
    from 2S to S and the oldest page (z) must leave at once: with the old window kept, it
    stays (fails with the window not summed again after the move)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Exp(), _Again())
    x = torch.randn(64, 64, requires_grad=True)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    store = watched_store(model)
    size = 64 * 64 * 4  # S
    with store.saving(0, keep=[x], backward_next=True):
        loss = model(x)
    entry = store._mbs[0]
    assert [p.layer for p in entry.pages] == [0, 1, 1]  # z, exp(z), y
    assert entry.layer_bytes[:2] == [size, 2 * size]
    assert store.stats.offloaded_step_bytes == size  # z left when y came up to layer 1
    assert store.budget.resident["activations"] == 2 * size
    store.fetch(0)
    loss.backward()
    store.release(0)
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
