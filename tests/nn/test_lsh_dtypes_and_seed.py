"""LSHSoftmax across dtypes and checkpoints: float64 losses, eval on another dtype's
activations, hash functions that stay fp32 under a cast, and redraws from the saved seed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from myelin.nn import LazyAdam, LSHSoftmax, soft_target_loss

H, C = 16, 300


def test_a_float64_layer_computes_its_loss_in_float64_and_passes_gradcheck():
    # the loss was taken in fp32 (`logits.float()`), so float64 gradients were fp32-rounded
    torch.manual_seed(0)
    head = LSHSoftmax(8, 50, bits=3, tables=2, min_active=50).double()  # all classes active
    h = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[1, 4], [2, -1], [7, 7]])
    assert head(h, labels).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda x: head(x, labels), (h,))
    # bf16 logits are still raised to fp32, and the eval loss keeps float64
    logits = torch.randn(3, 50)
    assert soft_target_loss(logits.bfloat16(), labels).dtype == torch.float32
    assert soft_target_loss(logits.double(), labels).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_eval_takes_activations_of_another_dtype_as_training_does(dtype):
    # training cast h to the layer's dtype; eval passed it as given, and the matmul failed
    torch.manual_seed(0)
    head = LSHSoftmax(H, C, bits=3, tables=4, min_active=20).to(dtype)
    h = torch.randn(4, H)  # fp32, from an fp32 body
    head(h, torch.tensor([1, 2, 3, 4]))
    head.eval()
    exact = head(h, inference="exact")
    assert exact.dtype == dtype
    assert torch.equal(exact, F.linear(h.to(dtype), head.weight, head.bias))
    lsh = head(h, inference="lsh")
    kept = torch.isfinite(lsh)
    assert lsh.dtype == dtype and kept.any()
    assert torch.allclose(lsh[kept].double(), exact[kept].double(), rtol=1e-2, atol=1e-2)
    # the classes kept are those retrieved for h as given, as in training
    ids, row = head._retrieve(h)
    got = kept.nonzero()
    assert torch.equal(got[:, 0] * C + got[:, 1], torch.unique(row * C + ids))


@pytest.mark.parametrize("family", ["simhash", "dwta"])
def test_a_dtype_cast_leaves_the_hash_functions_fp32_and_the_codes_unchanged(family):
    # `.to(torch.bfloat16)` rounded the SimHash projections, so the same vectors got other
    # codes than the tables were built with (hashing is documented as fp32 in any dtype)
    head = LSHSoftmax(H, C, family=family, bits=8, tables=8, bin_size=4)
    x = torch.randn(200, H).relu()
    before = head.hasher(x)
    projection = head.hasher.projection.clone()
    for dtype in (torch.bfloat16, torch.float64, torch.float32):
        head.to(dtype)
        assert head.weight.dtype == dtype
        assert head.hasher.projection.dtype == torch.float32
        assert torch.equal(head.hasher.projection, projection)
        assert torch.equal(head.hasher(x), before)
        assert head.tables.hasher is head.hasher
    head.half()
    assert torch.equal(head.hasher(x), before)


def _train(head: LSHSoftmax, opt: LazyAdam, steps: int, seed: int) -> list[float]:
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + s)
        h = torch.randn(8, H, generator=g)
        loss = head(h, torch.randint(C, (8, 2), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["simhash", "dwta"])
def test_a_checkpoint_carries_the_seed_its_later_redraws_come_from(family):
    # the seed was a plain attribute: a checkpoint loaded into a layer built with another
    # seed trained identically only until the first redraw, which used the new seed
    def fresh(seed: int) -> tuple[LSHSoftmax, LazyAdam]:
        head = LSHSoftmax(H, C, family=family, bits=4, tables=4, bin_size=4, min_active=40,
                          redraw_every=3, seed=seed)  # fmt: skip
        return head, LazyAdam(head.parameters(), lr=0.05)

    head, opt = fresh(1)
    _train(head, opt, 2, seed=0)
    state = copy.deepcopy((head.state_dict(), opt.state_dict()))
    expected = _train(head, opt, 5, seed=1)  # redraws at steps 3 and 6
    assert int(head.draws) == 2
    other, other_opt = fresh(2)
    other.load_state_dict(state[0])
    other_opt.load_state_dict(state[1])
    assert _train(other, other_opt, 5, seed=1) == expected
    assert int(other.hasher.seed) == 1
    for name, value in head.state_dict().items():
        assert torch.equal(value, other.state_dict()[name]), name


def test_a_checkpoint_from_before_the_seed_was_saved_loads_and_keeps_the_layers_seed():
    head = LSHSoftmax(H, C, bits=3, tables=4, seed=1)
    state = {k: v for k, v in head.state_dict().items() if not k.endswith("hasher.seed")}
    other = LSHSoftmax(H, C, bits=3, tables=4, seed=2)
    other.load_state_dict(state)  # strict: the missing seed is not an error
    assert int(other.hasher.seed) == 2
    assert torch.equal(other.hasher.projection, head.hasher.projection)
