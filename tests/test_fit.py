"""Trainer.fit and Trainer.evaluate over plain data loaders."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from myelin import ConfigError, Trainer

SGD = functools.partial(torch.optim.SGD, lr=0.5)


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def trainer():
    torch.manual_seed(0)
    return Trainer(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        SGD,
        F.cross_entropy,
        microbatches=2,
    )


def test_fit_equals_a_loop_of_steps_and_logs_metrics():
    loader = DataLoader(data(), batch_size=8)
    seen = []
    with trainer() as a, trainer() as b:
        history = a.fit(
            loader,
            epochs=2,
            eval_loader=DataLoader(data(seed=1), batch_size=8),
            eval_every=4,
            log_every=2,
            progress=False,
            callbacks=[lambda t, m: seen.append(m["step"])],
        )
        losses = [b.step(x, y) for _ in range(2) for x, y in loader]
        assert a.steps_done == b.steps_done == 16
        for pa, pb in zip(a.module.parameters(), b.module.parameters()):
            assert torch.equal(pa, pb)
    assert [h["step"] for h in history] == list(range(2, 17, 2)) and seen == list(range(2, 17, 2))
    assert history[-1]["loss"] == losses[-1]
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    assert len(vals) == 4 and vals[-1] < vals[0]
    assert all(h["tokens_per_s"] > 0 and 0 <= h["idle_frac"] <= 1 for h in history)


def test_fit_by_steps_cycles_the_loader_and_evaluate_averages_batches():
    loader = DataLoader(data(16), batch_size=8)
    with trainer() as t:
        history = t.fit(loader, steps=5, progress=False)
        assert t.steps_done == 5 and history[-1]["step"] == 5
        expected = sum(t.eval_step(x, y) for x, y in loader) / 2
        assert t.evaluate(loader) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "steps=0 must be an int >= 1"),
        ({"steps": 2, "epochs": 1}, "not both"),
        ({"eval_every": 2}, "eval_every needs an eval_loader"),
        ({"log_every": 0}, "log_every=0"),
    ],
)
def test_bad_fit_arguments_are_named(kwargs, message):
    with trainer() as t, pytest.raises(ConfigError, match=message):
        t.fit([], progress=False, **kwargs)


def test_a_loader_of_the_wrong_shape_is_named():
    with trainer() as t, pytest.raises(ConfigError, match="pairs, got tuple of length 3"):
        t.fit([(1, 2, 3)], progress=False)
