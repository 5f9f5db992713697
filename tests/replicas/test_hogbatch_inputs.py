"""Hogbatch on what users bring: a module keeping its own statistics, float64 data from
numpy, sparse or scalar tensors, and the busy fractions of a run stopped by its clock."""

from __future__ import annotations

import functools

import pytest
import torch

import myelin
from myelin.errors import ConfigError
from tests.replicas._problem import problem

SGD = functools.partial(torch.optim.SGD, lr=0.05, weight_decay=0.01)


class RunningNorm(torch.nn.Module):
    """Inputs minus their running mean, updated in each training forward (as in RL)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


class FixedNorm(RunningNorm):
    """The same buffer, only read by the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.mean


def test_a_module_updating_its_own_buffer_in_forward_is_refused_naming_it():
    # each worker updated its private copy; the model kept mean 0 while its Linear learned
    # centred inputs: predictions off by w . mean, silently
    _, data, _ = problem()
    model = torch.nn.Sequential(RunningNorm(8), torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(48, 48), adaptive=False, timeout_s=60)
    want = r"module '0' \(RunningNorm\) updates its buffer 'mean' in a training forward"
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=hog) as trainer:
        with pytest.raises(ConfigError, match=want):
            trainer.fit(data, epochs=1)
        assert trainer.steps_done == 0
    with pytest.raises(ConfigError, match=want):
        hog.fit(model, SGD(model.parameters()), torch.nn.MSELoss(), data)
    assert torch.equal(model[0].mean, torch.zeros(8))  # the probe ran on a copy
    # a buffer the forward only reads is shared as it is: no refusal
    model = torch.nn.Sequential(FixedNorm(8), torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    hog.fit(model, SGD(model.parameters()), torch.nn.MSELoss(), data)


def test_float64_inputs_train_as_the_stages_dtype_as_the_plain_trainer_casts_them():
    # a numpy float64 array was a dtype error in the workers (Double and Float)
    model, (x, y), _ = problem()
    twin = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    twin.load_state_dict(model.state_dict())
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(48, 48), adaptive=False, lock=True,
                          timeout_s=60)  # fmt: skip
    states = []
    for net, inputs in ((model, x.double()), (twin, x)):
        with myelin.Trainer(net, SGD, torch.nn.MSELoss(), sync=hog) as trainer:
            rows = trainer.fit((inputs, y), epochs=1, eval_loader=(inputs[:64], y[:64]))
            states.append(trainer.state_dict())
            assert "val_loss" in rows[-1]
    assert all(torch.equal(a, b) for a, b in zip(states[0].values(), states[1].values()))


def test_sparse_and_scalar_tensors_are_refused_saying_what_to_pass():
    model, (x, y), _ = problem()
    hog = myelin.Hogbatch(cpu_workers=0, timeout_s=60)
    opt = SGD(model.parameters())
    with pytest.raises(ConfigError, match=r"dense tensors.*to_dense\(\)"):
        hog.fit(model, opt, torch.nn.MSELoss(), (x.to_sparse(), y))  # was a torch layout error
    with pytest.raises(ConfigError, match="two tensors of equal length"):
        hog.fit(model, opt, torch.nn.MSELoss(), (x, torch.tensor(1.0)))  # was an IndexError


def test_busy_fractions_stay_within_one_when_max_seconds_stops_the_run():
    # busy time counted the batches landing while the run stopped, wall time did not: 2.66
    model, data, _ = problem()
    hog = myelin.Hogbatch(cpu_workers=1, cpu_batch=4, device_batch=(32, 32), adaptive=False,
                          emulate=((0.2, 0.0), (0.05, 0.0)), timeout_s=60)  # fmt: skip
    rep = hog.fit(model, SGD(model.parameters()), torch.nn.MSELoss(), data, epochs=3,
                  max_seconds=0.3)  # fmt: skip
    busy = [w["busy"] for w in rep["workers"]]
    assert all(0 < b <= 1.0 for b in busy), busy
    assert rep["workers"][0]["updates"] >= 1  # the device's batch in flight landed, counted
