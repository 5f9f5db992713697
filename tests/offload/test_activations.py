"""ActivationStore: paged-out activations give bit-identical gradients, reuse the pool, and
keep the device budget's accounting right.

Run: python -m pytest -q tests/offload/test_activations.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from myelin import DeviceMemoryError, HostMemoryError
from myelin.models import GPT, GPTConfig, lm_loss
from myelin.offload.activations import ActivationStore
from myelin.offload.budget import DeviceBudget
from myelin.offload.pages import bytes_of
from myelin.offload.pool import HostPool

CPU = torch.device("cpu")
GIB = 1 << 30
MICROBATCHES = 4


pytestmark = pytest.mark.usefixtures("one_thread", "roomy_machine")


# -- models that save different kinds of tensors ------------------------------------------


class TransposedView(nn.Module):
    """Saves non-contiguous views with a storage offset: `h[:, 4:].t() @ g`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 28)
        self.b = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.a(x), self.b(x)  # (B, 28), (B, 12)
        return torch.tanh(h[:, 4:].t() @ g)  # (24, B) @ (B, 12) -> (24, 12)


class SliceOfBig(nn.Module):
    """Saves small slices of a big activation (kept whole on the device, not paged) and of a
    buffer (persistent, never copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 512)
        self.w = nn.Parameter(torch.randn(8, 8) / 8)
        self.register_buffer("table", torch.randn(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = self.lin(x)  # (B, 512)
        small = big[:, 8:16]  # 1/64 of big's storage
        return torch.sin(small) @ self.w * self.table[: x.shape[0]]


class SavesOutputs(nn.Module):
    """tanh and sigmoid save their outputs, not their inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return torch.sigmoid(self.fc2(h)) * h[:, :16]


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )


def gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, d_model=32))


def float_batches(n: int = MICROBATCHES, rows: int = 16) -> list[tuple[torch.Tensor, None]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 16, generator=g), None) for _ in range(n)]


def token_batches(n: int = MICROBATCHES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (2, 32), generator=g), torch.randint(0, 64, (2, 32), generator=g))
        for _ in range(n)
    ]


def square_loss(out: torch.Tensor, _target: None) -> torch.Tensor:
    return out.float().pow(2).mean()


# name -> (model builder, batches, loss)
CASES = {
    "mlp": (mlp, float_batches, square_loss),
    "gpt": (gpt, token_batches, lm_loss),
    "transposed": (TransposedView, float_batches, square_loss),
    "slice_of_big": (SliceOfBig, float_batches, square_loss),
    "saves_outputs": (SavesOutputs, float_batches, square_loss),
}


def build(name: str) -> tuple[nn.Module, list, object]:
    make, batches, loss_fn = CASES[name]
    torch.manual_seed(0)
    return make(), batches(), loss_fn


def stage_input(x: torch.Tensor) -> torch.Tensor:
    """A fresh input per run; float inputs need a gradient, as on a middle pipeline stage."""
    x = x.clone()
    return x.requires_grad_(True) if x.is_floating_point() else x


def make_store(model: nn.Module, pool: HostPool | None, budget=None, **kw) -> ActivationStore:
    persistent = [*model.parameters(), *model.buffers()]
    budget = budget if budget is not None else DeviceBudget(CPU)
    return ActivationStore(CPU, budget, pool=pool, persistent=persistent, **kw)


def grads_of(model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    return grads + [x.grad.clone() for x in inputs if x.grad is not None]


def plain_grads(model, batches, loss_fn, order=None) -> list[torch.Tensor]:
    """All forwards, then the backwards in `order`, with no hooks at all."""
    model.zero_grad(set_to_none=True)
    inputs = [stage_input(x) for x, _ in batches]
    losses = [loss_fn(model(x), y) for x, (_, y) in zip(inputs, batches)]
    for mb in order or range(len(batches)):
        losses[mb].backward()
    return grads_of(model, inputs)


def stored_grads(model, batches, loss_fn, store, order=None, prefetch=True, backward_next=False):
    """The same under the store: forwards under `saving`, backwards with fetch and release."""
    model.zero_grad(set_to_none=True)
    inputs = [stage_input(x) for x, _ in batches]
    losses = []
    for mb, (x, (_, y)) in enumerate(zip(inputs, batches)):
        with store.saving(mb, keep=[x], backward_next=backward_next):
            losses.append(loss_fn(model(x), y))
    for mb in order or range(len(batches)):
        if prefetch:
            store.prefetch_ahead()
        store.fetch(mb)
        losses[mb].backward()
        store.release(mb)
    return grads_of(model, inputs)


def assert_all_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"gradient {i} differs: max {(a - b).abs().max().item()}"


# -- bit-identical gradients ----------------------------------------------------------------


@pytest.mark.parametrize("min_bytes", [0, 1024])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_gradients_equal_plain_autograd(name, min_bytes):
    model, batches, loss_fn = build(name)
    expected = plain_grads(model, batches, loss_fn)
    pool = HostPool(slab_bytes=1 << 20)
    store = make_store(model, pool, min_bytes=min_bytes)
    got = stored_grads(model, batches, loss_fn, store)
    assert_all_equal(got, expected)
    if name != "slice_of_big":  # there the only big tensors are slices: kept, not paged
        assert store.stats.pages > 0
    assert pool.in_use_bytes == 0
    assert store.budget.resident["activations"] == 0


def rebuilt_over_pages(store: ActivationStore) -> ActivationStore:
    """`store` as on a GPU, emulated on the CPU: a saved tensor is rebuilt over its page's
    bytes in backward (`View`, its offset and strides), not kept as itself."""
    store._copier.moves = True
    store._copier.own = bytes_of  # the forward's storage as uint8, as the GPU's copies read it
    return store


@pytest.mark.parametrize("name", list(CASES))
def test_saved_tensors_rebuilt_over_their_pages_equal_plain_autograd(name):
    model, batches, loss_fn = build(name)
    expected = plain_grads(model, batches, loss_fn)
    pool = HostPool(slab_bytes=1 << 20)
    store = rebuilt_over_pages(make_store(model, pool, min_bytes=0))
    assert_all_equal(stored_grads(model, batches, loss_fn, store), expected)
    assert pool.in_use_bytes == 0 and store.budget.resident["activations"] == 0


def test_a_second_backward_over_used_up_pages_is_named():
    """Pages go back to the pool as backward uses them, so a second backward over the same
    graph (retain_graph=True) cannot have them: a clear error, not a failed assertion."""
    model, batches, loss_fn = build("mlp")
    store = rebuilt_over_pages(make_store(model, HostPool(slab_bytes=1 << 20), min_bytes=0))
    x, y = batches[0]
    with store.saving(0):
        loss = loss_fn(model(stage_input(x)), y)
    store.fetch(0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="microbatch 0 were needed again.*retain_graph"):
        loss.backward()
    store.release(0)


@pytest.mark.parametrize("name", list(CASES))
def test_large_min_bytes_pages_nothing(name):
    model, batches, loss_fn = build(name)
    expected = plain_grads(model, batches, loss_fn)
    pool = HostPool(slab_bytes=1 << 20)
    store = make_store(model, pool, min_bytes=1 << 30)
    assert_all_equal(stored_grads(model, batches, loss_fn, store), expected)
    assert store.stats.pages == 0
    assert store.stats.offloaded_bytes == 0
    assert pool.grows == 0


@pytest.mark.parametrize("name", ["mlp", "gpt", "transposed"])
def test_out_of_order_backward_equal_and_counted_as_misses(name):
    """Without prefetch, each backward misses the page it needs first; the rest of the
    microbatch comes back ahead of where backward is."""
    model, batches, loss_fn = build(name)
    order = [2, 0, 3, 1]
    expected = plain_grads(model, batches, loss_fn, order)
    store = make_store(model, HostPool(slab_bytes=1 << 20), min_bytes=0)
    got = stored_grads(model, batches, loss_fn, store, order=order, prefetch=False)
    assert_all_equal(got, expected)
    assert store.stats.prefetch_misses == MICROBATCHES
    assert store.stats.prefetch_hits + MICROBATCHES == store.stats.pages > MICROBATCHES


def test_backward_without_fetch_still_equal():
    """A schedule the store did not foresee: unpack brings a page back by itself."""
    model, batches, loss_fn = build("mlp")
    expected = plain_grads(model, batches, loss_fn)
    store = make_store(model, HostPool(slab_bytes=1 << 20), min_bytes=0)
    model.zero_grad(set_to_none=True)
    inputs = [stage_input(x) for x, _ in batches]
    losses = []
    for mb, x in enumerate(inputs):
        with store.saving(mb, keep=[x]):
            losses.append(loss_fn(model(x), None))
    for mb, loss in enumerate(losses):
        loss.backward()
        store.release(mb)
    assert_all_equal(grads_of(model, inputs), expected)
    assert store.stats.prefetch_misses >= MICROBATCHES  # at least the first page of each
    assert store.stats.prefetch_hits + store.stats.prefetch_misses == store.stats.pages > 0
    assert store.pool.in_use_bytes == 0


def test_small_slice_of_a_big_storage_is_kept_not_paged():
    model, batches, loss_fn = build("slice_of_big")
    store = make_store(model, HostPool(slab_bytes=1 << 20), min_bytes=0)
    x = stage_input(batches[0][0])
    with store.saving(0, keep=[x]):
        loss = loss_fn(model(x), None)
    big = x.shape[0] * 512 * 4  # the (B, 512) fp32 storage behind the saved slice
    assert store.stats.offloaded_bytes < big
    assert store.budget.resident["activations"] >= big + x.untyped_storage().nbytes()
    store.fetch(0)
    loss.backward()
    store.release(0)
    assert store.budget.resident["activations"] == 0


def test_views_of_one_live_storage_share_a_page():
    x = torch.randn(64, 64, requires_grad=True)
    store = ActivationStore(CPU, DeviceBudget(CPU), pool=HostPool(slab_bytes=1 << 20), min_bytes=0)
    with store.saving(0):
        h = x * 2
        a, b = h.split(32, dim=1)
        loss = (a.sin() + b.cos()).sum()
    assert store.stats.pages == 1
    assert store.stats.offloaded_bytes == h.untyped_storage().nbytes()
    store.fetch(0)
    loss.backward()
    store.release(0)


def test_temporary_views_of_one_storage_share_a_page():
    x = torch.randn(64, 64, requires_grad=True)
    store = ActivationStore(CPU, DeviceBudget(CPU), pool=HostPool(slab_bytes=1 << 20), min_bytes=0)
    with store.saving(0):
        h = x * 2  # 16 KiB, alive throughout
        loss = (F.silu(h[:, :32]) * h[:, 32:]).sum()  # saves h[:, :32], silu(.), h[:, 32:]
    assert store.stats.pages == 2  # h once, silu's output once
    store.fetch(0)
    loss.backward()
    store.release(0)


# -- the pool -------------------------------------------------------------------------------


def test_cpu_pages_are_adopted_not_copied_and_steady_across_steps():
    """On a CPU the pool answers for paged-out storages without a slab or a copy: the page
    backward gets is the forward's own memory, and the bytes go back at release."""
    model, batches, loss_fn = build("gpt")
    pool = HostPool(slab_bytes=1 << 20)
    store = make_store(model, pool, min_bytes=0)
    saved_ptrs: set[int] = set()
    pack = store._copier.copy_out

    def copy_out(page, pool_):
        saved_ptrs.add(page.device_copy.data_ptr())
        pack(page, pool_)
        assert page.host.data_ptr() == page.device_copy.data_ptr()  # the same memory

    store._copier.copy_out = copy_out
    seen = []
    for _ in range(4):
        store.begin_step()
        pool.reset_peak()
        stored_grads(model, batches, loss_fn, store)
        assert pool.in_use_bytes == 0 and pool.stats()["adopted_bytes"] == 0
        seen.append((pool.grows, pool.peak_bytes, store.stats.offloaded_step_bytes))
    assert saved_ptrs
    assert all(s == seen[0] for s in seen), seen
    grows, peak, offloaded = seen[0]
    assert grows == 0 and 0 < peak <= offloaded + 64 * store.stats.pages
    assert store.stats.offloaded_bytes == 4 * offloaded


def test_pages_go_back_to_the_pool_as_backward_uses_them():
    """A page is used up once backward has unpacked and dropped every view of it: its host
    memory goes back then (as autograd frees saved tensors), not at the microbatch's end."""
    model, batches, loss_fn = build("gpt")
    pool = HostPool(slab_bytes=1 << 20)
    store = make_store(model, pool, min_bytes=0)
    x, y = batches[0]
    with store.saving(0):
        loss = loss_fn(model(x), y)
    out_after_forward = pool.in_use_bytes
    seen = []  # the pool's bytes when backward reaches the embedding (the first layer)
    model.embed.wte.weight.register_hook(lambda g: seen.append(pool.in_use_bytes))
    store.fetch(0)
    loss.backward()
    assert out_after_forward > 0 and seen
    assert seen[0] < out_after_forward / 2, (seen, out_after_forward)
    store.release(0)
    assert pool.in_use_bytes == 0


class _ReadsTwice(torch.autograd.Function):
    """x * x whose backward reads its saved tensor twice, as `ctx.saved_tensors` allows."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        return h * h

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return g * (h + again)


class _SharedPage(nn.Module):
    """h is saved twice: by a product, then by `_ReadsTwice`, whose backward runs first
    and reads it twice; the product's backward still needs h after that."""

    def __init__(self, penalty: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.c = nn.Parameter(torch.randn(64))
        self.penalty = penalty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = (h * self.c + _ReadsTwice.apply(h)).sum()
        if self.penalty:  # a backward inside the forward, as a gradient penalty does
            (g,) = torch.autograd.grad(out, h, create_graph=True)
            out = out + g.square().sum()
        return out


@pytest.mark.parametrize("penalty", [False, True])
def test_a_page_is_used_up_only_once_each_saved_tensor_on_it_was_unpacked(penalty):
    """Unpacks are counted once per saved tensor, and only in the microbatch's own backward:
    a tensor read twice, or by a backward inside the forward, does not use its page up
    while another saved tensor on it is still to be read."""
    torch.manual_seed(0)
    model, x = _SharedPage(penalty), torch.randn(32, 64)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    pool = HostPool(slab_bytes=1 << 20)
    store = make_store(model, pool, min_bytes=0)
    with store.saving(0):
        loss = model(x)
    store.fetch(0)
    loss.backward()
    store.release(0)
    assert_all_equal([p.grad for p in model.parameters()], expected)
    assert store.stats.pages > 0 and pool.in_use_bytes == 0


# -- accounting -----------------------------------------------------------------------------


def gpipe_peak(pool: HostPool | None, limit: int | None = None) -> int:
    """The budget's peak over a 4-microbatch GPipe pass of the GPT (all F, then all B)."""
    model, batches, loss_fn = build("gpt")
    budget = DeviceBudget(CPU, limit)
    store = make_store(model, pool, budget, min_bytes=0)
    stored_grads(model, batches, loss_fn, store)
    assert budget.resident["activations"] == 0
    return budget.peak_bytes


def test_paging_lowers_the_peak():
    kept = gpipe_peak(None)
    paged = gpipe_peak(HostPool(slab_bytes=1 << 20))
    assert 0 < paged < kept / 2  # one microbatch back at a time, against all four


def test_accounting_counts_kept_storages_and_fetched_pages():
    model, batches, loss_fn = build("mlp")
    budget = DeviceBudget(CPU)
    store = make_store(model, HostPool(slab_bytes=1 << 20), budget, min_bytes=0)
    x = stage_input(batches[0][0])
    with store.saving(0, keep=[x]):
        loss = loss_fn(model(x), None)
    kept = budget.resident["activations"]
    assert kept == x.untyped_storage().nbytes()  # the input: held, so kept and accounted
    store.fetch(0)
    assert budget.resident["activations"] == kept + store.stats.offloaded_bytes
    loss.backward()
    store.release(0)
    assert budget.resident["activations"] == 0


def test_parameters_and_kept_inputs_are_never_copied():
    torch.manual_seed(0)
    lin = nn.Linear(256, 256)  # a 256 KiB weight, saved by the matmul
    store = make_store(lin, HostPool(slab_bytes=1 << 20), min_bytes=0)
    x = torch.randn(2, 256, requires_grad=True)
    with store.saving(0, keep=[x]):
        loss = lin(x).sum()
    assert store.stats.pages == 0
    assert store.stats.offloaded_bytes == 0
    assert store.budget.resident["activations"] == x.untyped_storage().nbytes()
    store.fetch(0)
    loss.backward()
    store.release(0)
    assert store.budget.resident["activations"] == 0


def test_backward_next_without_layers_keeps_everything():
    """A store that knows no layers sees one: the last, which a backward that follows at
    once needs first, so nothing is copied."""
    model, batches, loss_fn = build("mlp")
    expected = plain_grads(model, batches, loss_fn)
    pool = HostPool(slab_bytes=1 << 20)
    store = make_store(model, pool, min_bytes=0)
    assert store.pages_out
    got = stored_grads(model, batches, loss_fn, store, backward_next=True)
    assert_all_equal(got, expected)
    assert store.stats.pages == 0
    assert pool.grows == 0
    assert store.budget.peak_bytes > 0


# -- prefetch -------------------------------------------------------------------------------


def forwards(store: ActivationStore, name: str = "mlp") -> tuple[nn.Module, list]:
    model, batches, loss_fn = build(name)
    losses = []
    for mb, (x, y) in enumerate(batches):
        x = stage_input(x)
        with store.saving(mb, keep=[x]):
            losses.append(loss_fn(model(x), y))
    return model, losses


def test_prefetch_then_fetch_counts_hits():
    store = ActivationStore(CPU, DeviceBudget(CPU), pool=HostPool(slab_bytes=1 << 20), min_bytes=0)
    _, losses = forwards(store)
    per_mb = store.stats.pages // MICROBATCHES
    assert per_mb > 0
    for mb, loss in enumerate(losses):
        started = store.prefetch_ahead()
        assert started > 0
        assert store.prefetch_ahead() == 0  # already on its way
        store.fetch(mb)
        assert store.stats.prefetch_hits == mb * per_mb + 1  # the page backward needs first
        loss.backward()
        assert store.stats.prefetch_hits == (mb + 1) * per_mb
        store.release(mb)
    assert store.stats.prefetch_misses == 0
    assert store.prefetch_ahead() == 0  # nothing left in flight


def test_fetch_without_prefetch_misses_only_the_first_page():
    store = ActivationStore(CPU, DeviceBudget(CPU), pool=HostPool(slab_bytes=1 << 20), min_bytes=0)
    _, losses = forwards(store)
    for mb, loss in enumerate(losses):
        store.fetch(mb)
        assert store.stats.prefetch_misses == mb + 1
        loss.backward()
        store.release(mb)
    assert store.stats.prefetch_hits == store.stats.pages - MICROBATCHES > 0


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_prefetch_depth_brings_back_the_oldest(depth):
    pool = HostPool(slab_bytes=1 << 20)
    store = ActivationStore(CPU, DeviceBudget(CPU), pool=pool, min_bytes=0, prefetch=depth)
    _, losses = forwards(store)
    per_mb = store.stats.offloaded_bytes // MICROBATCHES
    assert store.prefetch_ahead() == depth * per_mb
    assert store.budget.resident["activations"] > 0
    for mb, loss in enumerate(losses):
        store.fetch(mb)
        loss.backward()
        store.release(mb)
    # Prefetched microbatches miss nothing; the others miss the page they need first.
    assert store.stats.prefetch_misses == MICROBATCHES - depth


# -- limits ---------------------------------------------------------------------------------


def test_device_limit_raises_without_paging_and_fits_with_it():
    kept = gpipe_peak(None)
    paged = gpipe_peak(HostPool(slab_bytes=1 << 20))
    limit = (kept + paged) // 2
    with pytest.raises(DeviceMemoryError) as err:
        gpipe_peak(None, limit)
    text = str(err.value)
    assert "device_memory_limit" in text
    assert "OffloadConfig(activations=True)" in text
    assert "activations" in text
    assert gpipe_peak(HostPool(slab_bytes=1 << 20), limit) == paged


def test_device_limit_error_leaves_counts_and_clear_releases():
    model, batches, loss_fn = build("gpt")
    budget = DeviceBudget(CPU, 64 << 10)
    store = make_store(model, None, budget, min_bytes=0)
    x = batches[0][0]
    with pytest.raises(DeviceMemoryError), store.saving(0, keep=[x]):
        loss_fn(model(x), batches[0][1])
    assert 0 < budget.resident["activations"] <= 64 << 10
    store.clear()
    assert budget.resident["activations"] == 0


def test_host_limit_error_propagates_out_of_the_forward():
    model, batches, loss_fn = build("gpt")
    pool = HostPool("48KiB", slab_bytes=16 << 10)
    budget = DeviceBudget(CPU)
    store = make_store(model, pool, budget, min_bytes=0)
    with pytest.raises(HostMemoryError, match="host_memory_limit"):
        for mb, (x, y) in enumerate(batches):
            with store.saving(mb, keep=[x]):
                loss_fn(model(x), y)
    assert pool.in_use_bytes > 0  # the pages made before the error
    store.clear()
    assert pool.in_use_bytes == 0
    assert budget.resident["activations"] == 0
    # The pool stays usable: a small microbatch pages out and back again.
    mlp_model, mlp_batches, mlp_loss = build("mlp")
    small = [(x[:2], y) for x, y in mlp_batches[:1]]
    store = make_store(mlp_model, pool, budget, min_bytes=0)
    got = stored_grads(mlp_model, small, mlp_loss, store)
    assert_all_equal(got, plain_grads(mlp_model, small, mlp_loss))
    assert store.stats.pages > 0
    assert pool.in_use_bytes == 0
