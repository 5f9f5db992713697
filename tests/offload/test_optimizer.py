"""Updater: the optimizer step with its state in the host pool ("host", "stream") gives the
same parameters as the ordinary step ("device"), in fp32, bf16 and fp16.

Run: python -m pytest -q tests/offload/test_optimizer.py
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from torch import nn

from myelin import ConfigError, DeviceMemoryError
from myelin.offload.budget import DeviceBudget
from myelin.offload.optimizer import Updater
from myelin.offload.pool import HostPool
from myelin.precision import DTYPES

CPU = torch.device("cpu")
GIB = 1 << 30
BUCKET = 2048  # bytes of fp32: the model below makes four buckets

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "sgd": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2),
    "adafactor": functools.partial(torch.optim.Adafactor, lr=1e-2),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-2, momentum=0.5),
}
ADAMW = OPTIMIZERS["adamw"]


pytestmark = pytest.mark.usefixtures("one_thread", "roomy_machine")


class Net(nn.Module):
    """Three layers, and a side layer that only even steps use (no gradient on odd ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)
        self.side = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        out = self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return out + self.side(x) if use_side else out


def net(precision: str = "fp32") -> Net:
    torch.manual_seed(0)
    return Net().to(DTYPES[precision])


def make_updater(model, mode, precision="fp32", opt=ADAMW, pool=None, **kw) -> Updater:
    if pool is None and mode != "device":
        pool = HostPool(slab_bytes=1 << 20)
    params = list(model.parameters())
    return Updater(
        params, opt, mode=mode, precision=precision, pool=pool, bucket_bytes=BUCKET, **kw
    )


def batches(steps: int, microbatches: int, seed: int = 1) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(microbatches)
        ]
        for _ in range(steps)
    ]


def train_step(model, updater, step_batches, step=0, arm=False, poison=False) -> bool:
    """Gradient accumulation over the microbatches, then one update. `arm`: stream the
    gradients to the host during the last backward; `poison`: an inf input (fp16 overflow)."""
    dtype = next(model.parameters()).dtype
    for k, (x, y) in enumerate(step_batches):
        x = x.to(dtype)
        if poison and k == 0:
            x[0, 0] = float("inf")
        if arm and k == len(step_batches) - 1:
            updater.arm()
        loss = (model(x, use_side=step % 2 == 0).float() - y).pow(2).mean() / len(step_batches)
        if updater.scaler is not None:
            loss = loss * updater.scaler.scale
        loss.backward()
    return updater.step()


def train(mode, precision, opt, steps=4, microbatches=2, arm=False):
    model = net(precision)
    updater = make_updater(model, mode, precision, OPTIMIZERS[opt])
    results = [
        train_step(model, updater, b, step, arm)
        for step, b in enumerate(batches(steps, microbatches))
    ]
    return model, updater, results


@functools.cache
def reference(precision: str, opt: str) -> tuple[list[torch.Tensor], list[bool]]:
    model, _, results = train("device", precision, opt)
    return [p.detach().clone() for p in model.parameters()], results


def assert_same_params(model: nn.Module, expected: list[torch.Tensor]) -> None:
    for i, (p, e) in enumerate(zip(model.parameters(), expected)):
        assert torch.equal(p, e), f"parameter {i} differs: max {(p - e).abs().max().item()}"


def paged_state(updater: Updater) -> list[torch.Tensor]:
    return [
        t
        for m in updater.masters
        for t in updater.optimizer.state.get(m, {}).values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]


# -- the same parameters in every mode ------------------------------------------------------


def _equivalence_cases():
    for precision in DTYPES:
        for opt in OPTIMIZERS:
            for mode, arm in (("host", False), ("host", True), ("stream", False)):
                yield pytest.param(precision, opt, mode, arm)


@pytest.mark.parametrize(("precision", "opt", "mode", "arm"), list(_equivalence_cases()))
def test_offloaded_step_equals_device_step(precision, opt, mode, arm):
    expected, expected_results = reference(precision, opt)
    model, updater, results = train(mode, precision, opt, arm=arm)
    assert results == expected_results
    assert any(results)
    assert_same_params(model, expected)
    assert len(updater._buckets) >= 3


@pytest.mark.parametrize("mode", ["host", "stream"])
def test_explicit_foreach_adafactor_is_exact(mode):
    """Given the same kernels (foreach=True), the offloaded Adafactor step is exact too."""
    opt = functools.partial(torch.optim.Adafactor, lr=1e-2, foreach=True)
    outcomes = []
    for m in ("device", mode):
        model = net()
        updater = make_updater(model, m, opt=opt)
        for step, b in enumerate(batches(4, 2)):
            assert train_step(model, updater, b, step)
        outcomes.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*outcomes):
        assert torch.equal(a, b)


def _state_cases():
    return [(opt, mode) for opt in OPTIMIZERS for mode in ("host", "stream")]


@pytest.mark.parametrize(("opt", "mode"), list(_state_cases()))
def test_state_and_masters_live_in_the_pool(opt, mode):
    model, updater, _ = train(mode, "fp32", opt, steps=2)
    if mode == "host":  # on a CPU in fp32 the parameters are host memory: updated in place
        assert all(m is p for m, p in zip(updater.masters, updater.params, strict=True))
        assert updater.host_bytes() == sum(t.numel() * 4 for t in paged_state(updater))
    else:
        assert all(updater.pool.owns(m) for m in updater.masters)
    state = paged_state(updater)
    assert state
    assert all(updater.pool.owns(t) for t in state)


def test_unused_parameter_keeps_its_value_and_state():
    """The side layer gets no gradient on odd steps: no mode may step it from a stale one."""
    for mode in ("device", "host", "stream"):
        model = net()
        updater = make_updater(model, mode)
        train_step(model, updater, batches(1, 1)[0], step=0)
        side = [p.detach().clone() for p in model.side.parameters()]
        train_step(model, updater, batches(1, 1, seed=2)[0], step=1)
        for p, before in zip(model.side.parameters(), side):
            assert torch.equal(p, before), mode


# -- fp16 overflow --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "arm"), [("device", False), ("host", False), ("host", True), ("stream", False)]
)
def test_fp16_overflow_skips_the_step(mode, arm):
    model = net("fp16")
    updater = make_updater(model, mode, "fp16")
    data = batches(3, 2)
    assert train_step(model, updater, data[0], 0, arm)
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in updater.masters]
    scale = updater.scaler.scale
    assert not train_step(model, updater, data[1], 1, arm, poison=True)
    assert updater.scaler.scale == scale / 2
    assert updater.scaler.skipped == 1
    assert_same_params(model, before)
    assert all(torch.equal(m, b) for m, b in zip(updater.masters, masters))
    assert all(p.grad is None for p in model.parameters())
    assert train_step(model, updater, data[2], 2, arm)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if mode != "device":  # the same as the ordinary step through the skip
        ref_model = net("fp16")
        ref = make_updater(ref_model, "device", "fp16")
        for step, b in enumerate(data):
            train_step(ref_model, ref, b, step, poison=step == 1)
        assert_same_params(model, list(ref_model.parameters()))


# -- checkpoints ----------------------------------------------------------------------------


def assert_state_equal(a: Updater, b: Updater) -> None:
    for ma, mb in zip(a.masters, b.masters):
        sa, sb = a.optimizer.state[ma], b.optimizer.state[mb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_round_trip_through_the_pool(precision):
    data = batches(4, 1)
    model = net(precision)
    updater = make_updater(model, "host", precision)
    for step in range(3):
        train_step(model, updater, data[step], step)
    sd = updater.state_dict()

    model2 = copy.deepcopy(model)
    pool2 = HostPool(slab_bytes=1 << 20)
    updater2 = make_updater(model2, "host", precision, pool=pool2)
    updater2.load_state_dict(sd)
    state = paged_state(updater2)
    assert state and all(pool2.owns(t) for t in state)
    if precision != "fp32":  # in fp32 on a CPU the masters are the parameters
        assert all(pool2.owns(m) for m in updater2.masters)
    assert_state_equal(updater, updater2)
    assert all(torch.equal(a, b) for a, b in zip(updater.masters, updater2.masters))

    train_step(model, updater, data[3], 3)
    train_step(model2, updater2, data[3], 3)
    assert_same_params(model2, list(model.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_state_dict_is_compact_and_saves_with_weights_only(precision):
    model = net(precision)
    updater = make_updater(model, "host", precision)
    for step, b in enumerate(batches(2, 1)):
        train_step(model, updater, b, step)
    sd = updater.state_dict()
    tensors = [t for s in sd["optimizer"]["state"].values() for t in s.values()]
    tensors += sd["masters"] or []
    assert tensors
    for t in tensors:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # not a whole slab
        assert not updater.pool.owns(t)
    assert (sd["masters"] is None) == (precision == "fp32")
    assert (sd["loss_scale"] is None) == (precision != "fp16")

    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    model2 = copy.deepcopy(model)
    updater2 = make_updater(model2, "host", precision)
    updater2.load_state_dict(loaded)
    assert_state_equal(updater, updater2)
    if updater.scaler is not None:
        assert updater2.scaler.state_dict() == updater.scaler.state_dict()
    step = batches(1, 1, seed=7)[0]
    train_step(model, updater, step, 2)
    train_step(model2, updater2, step, 2)
    assert_same_params(model2, list(model.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("src", "dst"),
    [("device", "host"), ("host", "device"), ("device", "stream"), ("stream", "host")],
)
def test_state_dict_moves_between_modes(src, dst, precision):
    data = batches(4, 1)
    model = net(precision)
    updater = make_updater(model, src, precision)
    for step in range(3):
        train_step(model, updater, data[step], step)
    model2 = copy.deepcopy(model)
    updater2 = make_updater(model2, dst, precision)
    updater2.load_state_dict(updater.state_dict())
    assert_state_equal(updater, updater2)
    if dst != "device":
        assert all(updater2.pool.owns(t) for t in paged_state(updater2))
    train_step(model, updater, data[3], 3)
    train_step(model2, updater2, data[3], 3)
    assert_same_params(model2, list(model.parameters()))


@pytest.mark.parametrize("mode", ["host", "stream"])
def test_loading_into_a_trained_updater_does_not_leak_the_pool(mode):
    model = net()
    updater = make_updater(model, mode)
    for step, b in enumerate(batches(2, 1)):
        train_step(model, updater, b, step)
    in_use = updater.pool.in_use_bytes
    sd = updater.state_dict()
    for _ in range(3):
        updater.load_state_dict(sd)
    assert updater.pool.in_use_bytes == in_use


# -- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["host", "stream"])
def test_pool_does_not_grow_in_the_steady_state(mode, precision):
    model = net(precision)
    updater = make_updater(model, mode, precision)
    seen = []
    for step, b in enumerate(batches(5, 2)):
        train_step(model, updater, b, step, arm=mode == "host")
        pool = updater.pool
        seen.append((pool.grows, pool.capacity_bytes, pool.in_use_bytes))
    assert all(s == seen[0] for s in seen), seen


def test_host_and_device_bytes_by_mode():
    n = sum(p.numel() for p in net().parameters())

    model = net()
    host = make_updater(model, "host")
    assert host.host_bytes() == 0  # on a CPU in fp32: masters and grads are the parameters'
    train_step(model, host, batches(1, 1)[0])
    assert host.host_bytes() == 8 * n  # exp_avg and exp_avg_sq
    assert host.device_bytes() == 0

    model = net("bf16")
    host = make_updater(model, "host", "bf16")
    assert host.host_bytes() == 8 * n  # fp32 masters and gradients, before any state exists
    train_step(model, host, batches(1, 1)[0])
    assert host.host_bytes() == 16 * n  # + exp_avg and exp_avg_sq
    assert host.device_bytes() == 0

    model = net()
    stream = make_updater(model, "stream")
    train_step(model, stream, batches(1, 1)[0])
    assert stream.host_bytes() == 12 * n  # no host gradients: they stay on the device
    assert 0 < stream.device_bytes() < 12 * n  # a bucket or two staged at a time

    model = net()
    device = make_updater(model, "device")
    train_step(model, device, batches(1, 1)[0])
    assert device.host_bytes() == 0
    assert device.device_bytes() >= 8 * n

    model = net("bf16")
    device = make_updater(model, "device", "bf16")
    train_step(model, device, batches(1, 1)[0])
    # between steps: the fp32 masters and AdamW's two moments; the masters' fp32 gradients
    # are counted as "gradients", during the step only
    state = sum(t.numel() * t.element_size() for s in device.optimizer.state.values()
                for t in s.values())  # fmt: skip
    assert device.device_bytes() == 4 * n + state and 8 * n <= state < 9 * n


def test_a_streamed_steps_staging_is_counted_at_its_peak_and_not_after():
    n = sum(p.numel() for p in net().parameters())
    params = 4 * n
    model = net()
    budget = DeviceBudget(CPU, None)
    budget.set("parameters", params, "placing the parameters")
    updater = make_updater(model, "stream", budget=budget)
    for step, b in enumerate(batches(3, 1)):
        train_step(model, updater, b, step)
        assert budget.resident["optimizer"] == 0  # nothing of the step stays on the device
    staged = updater.device_bytes()
    assert 0 < staged and budget.peak_bytes >= params + staged


def test_device_limit_raises_for_device_state_but_not_for_host_state():
    n = sum(p.numel() for p in net().parameters())
    params = 4 * n
    for mode in ("device", "host"):
        model = net()
        budget = DeviceBudget(CPU, params + 4 * n)  # less than the 8 bytes a parameter of AdamW
        budget.set("parameters", params, "placing the parameters")
        updater = make_updater(model, mode, budget=budget)
        if mode == "device":
            with pytest.raises(DeviceMemoryError) as err:
                train_step(model, updater, batches(1, 1)[0])
            assert "OffloadConfig(optimizer=True)" in str(err.value)
            assert "the optimizer step" in str(err.value)
            assert budget.resident["optimizer"] == 0
            continue
        for step, b in enumerate(batches(3, 1)):
            assert train_step(model, updater, b, step)
        assert budget.resident["optimizer"] == 0
        assert budget.peak_bytes == params


def test_bad_construction_is_a_config_error():
    params = list(net().parameters())
    with pytest.raises(ConfigError, match="needs a host pool"):
        Updater(params, ADAMW, mode="host")
    with pytest.raises(ConfigError, match="not a torch.optim.Optimizer"):
        Updater(params, lambda ps: object())


class CountingSGD(torch.optim.Optimizer):
    """SGD whose step size decays with a counter of the group's own steps: state that
    is not any parameter's, which a step a bucket at a time would advance per bucket."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["count"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_an_optimizer_with_state_across_parameters_steps_once_under_host_offload(precision):
    """Four buckets, one optimizer step: the group's counter reads the steps taken (it read
    steps x buckets) and the parameters equal the device mode's."""
    model = net(precision)
    updater = make_updater(model, "host", precision, CountingSGD)
    assert len(updater._buckets) == 1
    ref_model = net(precision)
    ref = make_updater(ref_model, "device", precision, CountingSGD)
    for step, b in enumerate(batches(3, 2)):
        assert train_step(model, updater, b, step, arm=True)
        assert train_step(ref_model, ref, b, step)
    assert updater.optimizer.param_groups[0]["count"] == 3
    assert_same_params(model, [p.detach() for p in ref_model.parameters()])


def test_stream_offload_refuses_an_optimizer_with_state_across_parameters():
    with pytest.raises(ConfigError, match=r"'stream' steps the optimizer one bucket .*CountingSGD"):
        make_updater(net("bf16"), "stream", "bf16", CountingSGD)

    class Declared(CountingSGD):
        per_parameter_state = True  # the user's word that each parameter steps alone

    assert len(make_updater(net("bf16"), "stream", "bf16", Declared)._buckets) == 4
