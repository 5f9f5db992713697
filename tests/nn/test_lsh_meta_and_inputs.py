"""LSHSoftmax built on the meta device (myelin.init_empty) and materialised, and the inputs
its loss refuses or takes: an empty active set, hidden activations for logits, bool labels."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import myelin
from myelin.init import is_meta, materialize
from myelin.nn import LazyAdam, LSHSoftmax

IN, H, C = 24, 16, 300


def _model(family: str = "simhash") -> nn.Sequential:
    head = LSHSoftmax(H, C, family=family, bits=3, tables=4, min_active=40, check_every=2, seed=3)
    return nn.Sequential(nn.Linear(IN, H), nn.ReLU(), head)


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, IN, generator=g), torch.randint(C, (8, 2), generator=g)) for _ in range(n)
    ]


@pytest.mark.parametrize("family", ["simhash", "dwta"])
@pytest.mark.parametrize("empty", [myelin.init_empty, lambda: torch.device("meta")])
def test_a_meta_built_layer_materialises_to_the_layer_built_normally(family, empty):
    # building read the meta seed buffer with int() and hashed meta weights: it raised
    with empty():
        meta = _model(family)
    assert is_meta(meta)
    materialize(meta, meta, list(meta), 0)
    eager = _model(family)
    myelin.init_layers(eager, list(eager))  # the Linear as the meta path draws it
    want, got = eager.state_dict(), meta.state_dict()
    assert want.keys() == got.keys()
    for name, value in want.items():  # weights, hash functions, tables, generators, counters
        assert torch.equal(value, got[name]), name
    x, y = _batches(1)[0]
    assert torch.equal(eager[2].loss(eager[:2](x), y), meta[2].loss(meta[:2](x), y))
    assert torch.equal(eager[2].active, meta[2].active)


def test_trainer_trains_a_meta_built_lsh_model_as_the_eager_one():
    eager = _model()
    myelin.init_layers(eager, list(eager))
    with myelin.init_empty():
        meta = _model()
    opt = functools.partial(LazyAdam, lr=0.01)
    losses = []
    for model in (eager, meta):
        with myelin.Trainer(model, opt, model[2].loss) as t:
            losses.append([t.step(x, y) for x, y in _batches()])
            assert not is_meta(t.module)
    assert losses[0] == losses[1]
    assert meta[2].stats["checks"] == 2  # the layer counted its steps from 0


def test_a_meta_layer_allocated_but_not_initialised_refuses_to_run():
    with myelin.init_empty():
        head = LSHSoftmax(H, C, bits=3, tables=4)
    head.to_empty(device="cpu")  # garbage weights and tables, no reset_parameters
    h, y = torch.randn(2, H), torch.tensor([1, 2])
    with pytest.raises(myelin.ConfigError, match="reset_parameters"):
        head(h, y)
    head.load_state_dict(LSHSoftmax(H, C, bits=3, tables=4).state_dict())  # or a checkpoint
    assert torch.isfinite(head(h, y))


def test_an_empty_active_set_gives_a_zero_loss_and_gradient():
    # min_active=0, rows all padding and tables that return nothing: logits (B, 0), and the
    # loss gathered column 0 of them; LazyAdam then failed on the gradient of no rows
    torch.manual_seed(0)
    head = LSHSoftmax(8, 50, bits=30, tables=2, min_hits=2, min_active=0)
    before = head.weight.detach().clone()
    opt = LazyAdam(head.parameters())
    h = torch.randn(3, 8, requires_grad=True)
    loss = head(h, torch.full((3, 2), -1))
    assert head.active.numel() == 0 and loss.item() == 0.0
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h))
    opt.step()
    assert torch.equal(head.weight, before)


def test_loss_refuses_an_output_of_the_other_mode_naming_the_shape_it_takes():
    # eval took hidden (B, in_features) as logits and returned a plausible wrong number
    torch.manual_seed(0)
    head = LSHSoftmax(H, 50, bits=2, tables=2, min_active=10)
    h, y = torch.randn(4, H), torch.tensor([1, 5, 9, 3])
    head.eval()
    with pytest.raises(myelin.ConfigError, match=r"\(4, 16\) must be \(B, 50\), the logits"):
        head.loss(h, y)
    logits = head(h)
    head.train()
    with pytest.raises(myelin.ConfigError, match=r"\(4, 50\) must be \(B, 16\), the hidden"):
        head.loss(logits, y)
    with pytest.raises(myelin.ConfigError, match=r"\(16,\) must be \(B, 16\)"):
        head.loss(h[0], y[:1])


def test_bool_labels_are_refused_as_float_labels_are():
    head = LSHSoftmax(H, 50, bits=2, tables=2)
    for labels in (torch.tensor([True, False]), torch.tensor([0.0, 1.0])):
        with pytest.raises(myelin.ConfigError, match=f"labels .* got {labels.dtype}"):
            head(torch.randn(2, H), labels)
