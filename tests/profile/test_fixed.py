"""Fixed-time layers: the time they take, and gradients as for y = x * w."""

from __future__ import annotations

import time

import pytest
import torch

from myelin.errors import ConfigError
from myelin.profile.fixed import FixedTime, fixed_time_model


def test_forward_and_backward_take_their_fixed_time():
    layer = FixedTime(0.02, 0.04)
    x = torch.randn(4, 3, requires_grad=True)
    start = time.perf_counter()
    y = layer(x)
    mid = time.perf_counter()
    y.sum().backward()
    end = time.perf_counter()
    assert 0.02 <= mid - start < 0.1 and 0.04 <= end - mid < 0.15


def test_gradients_are_those_of_a_scaling():
    model = fixed_time_model(3, 0.0, 0.0)
    with torch.no_grad():
        for i, layer in enumerate(model):
            layer.weight.fill_(i + 2.0)  # 2 * 3 * 4 = 24
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = model(x)
    assert torch.allclose(y, 24 * x)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 24.0))
    assert float(model[0].weight.grad) == pytest.approx(
        float(x.detach().sum()) * 12, rel=1e-5, abs=1e-5
    )
    with torch.no_grad():
        assert torch.allclose(model(x), 24 * x)  # evaluation sleeps the forward time only


@pytest.mark.parametrize(
    ("args", "match"),
    [((-1, 0), "forward_s=-1"), ((0, "1"), "backward_s='1'"), ((True, 0), "forward_s=True")],
)
def test_bad_times_are_refused(args, match):
    with pytest.raises(ConfigError, match=match):
        FixedTime(*args)
    with pytest.raises(ConfigError, match="layers=0"):
        fixed_time_model(0, 0.1, 0.1)
