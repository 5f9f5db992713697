"""LSHSoftmax under the Trainer's options: clipping, half precision, data parallelism, and
the soft-target loss where LSH inference leaves classes at -inf."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import myelin
from myelin.nn import LazyAdam, LSHSoftmax, soft_target_loss
from myelin.replicas.allreduce import average_gradients

IN, C = 32, 300


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    head = LSHSoftmax(16, C, bits=4, tables=4, min_active=60, seed=3)
    return nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), head)


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, IN, generator=g), torch.randint(C, (8,), generator=g)) for _ in range(n)
    ]


def _trained(**kw) -> list[float]:
    model = _model()
    opt = functools.partial(LazyAdam, lr=0.01)
    with myelin.Trainer(model, opt, model[2].loss, **kw) as t:
        return [t.step(x, y) for x, y in _batches()]


def test_clipping_covers_the_layers_sparse_rows_as_one_process_would():
    got = _trained(max_grad_norm=0.5)
    model = _model()
    opt = LazyAdam(model.parameters(), lr=0.01)
    want = []
    for x, y in _batches():
        opt.zero_grad()
        loss = model[2].loss(model[:2](x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        norms = [
            torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g) for g in grads
        ]
        coef = min(1.0, 0.5 / (float(torch.linalg.vector_norm(torch.stack(norms))) + 1e-6))
        assert coef < 1.0  # the clip bites
        for g in grads:
            g.mul_(coef)
        opt.step()
        want.append(float(loss.detach()))
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_trains_the_layer_close_to_fp32(precision):
    full = _trained()
    half = _trained(precision=precision)
    assert all(math.isfinite(v) for v in half)
    assert half == pytest.approx(full, abs=2e-2)
    assert half[-1] < half[0]


def test_sparse_gradients_are_refused_by_allreduce_naming_the_parameter():
    model = _model()
    x, y = _batches(1)[0]
    model[2].loss(model[:2](x), y).backward()
    params = list(model.parameters())
    with pytest.raises(myelin.ConfigError, match=r"parameter 2 .*\(300, 16\).*data_parallel=1"):
        average_gradients(params, 0.0, group=None, replicas=2)


def test_padding_next_to_a_class_lsh_inference_left_out_is_not_nan():
    logits = torch.tensor([[-math.inf, 2.0, 1.0]])
    loss = soft_target_loss(logits, torch.tensor([[1, -1]]))
    assert loss == pytest.approx(-float(torch.log_softmax(torch.tensor([2.0, 1.0]), 0)[0]))
