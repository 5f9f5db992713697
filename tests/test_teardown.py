"""What a closed Trainer gives back: nothing of it stays alive, nothing stays changed.

A Trainer puts hooks on the user's model, sets process-wide settings (torch's CPU
threads, the garbage collector's freeze) and holds host memory (the pinned or plain host
pool). After `close()` a user building trainer after trainer in one process (a sweep, a
notebook, a retry after DeviceMemoryError) must get all of it back, however far the
constructor got. Workers are this process: one stage, no peers.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

import myelin
import myelin.trainer as trainer_module
from myelin import collector

BOTH = myelin.OffloadConfig(activations=True, optimizer=True, min_bytes=0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def trainer(net: torch.nn.Module | None = None, **kw) -> myelin.Trainer:
    kw.setdefault("microbatches", 2)
    return myelin.Trainer(
        net if net is not None else model(),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        torch.nn.functional.cross_entropy,
        **kw,
    )


def step(t: myelin.Trainer) -> None:
    g = torch.Generator().manual_seed(1)
    t.step(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))


def hooks_on(net: torch.nn.Module) -> list[str]:
    """Every hook a module or parameter of `net` holds, named."""
    found = []
    for name, m in net.named_modules():
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            found += [f"{name or 'root'}.{kind}"] * len(getattr(m, kind))
    for name, p in net.named_parameters():
        found += [f"{name}._post_accumulate_grad_hooks"] * len(
            getattr(p, "_post_accumulate_grad_hooks", None) or {}
        )
        found += [f"{name}._backward_hooks"] * len(p._backward_hooks or {})
    return found


def test_cpu_threads_are_put_back_at_close():
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    with trainer(cpu_threads=want) as t:
        assert torch.get_num_threads() == want
        step(t)
    assert torch.get_num_threads() == before


def test_cpu_threads_are_put_back_when_the_constructor_fails():
    before = torch.get_num_threads()
    with pytest.raises(TypeError, match="optimizer says no"):
        myelin.Trainer(
            model(),
            lambda params: (_ for _ in ()).throw(TypeError("optimizer says no")),
            torch.nn.functional.cross_entropy,
            cpu_threads=1 if before != 1 else 2,
        )
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_constructor_that_fails_late_leaves_no_hook_on_the_model(monkeypatch, precision):
    """The store's layer hooks and a bf16 trainer's gradient hooks go on the model before
    the event loop is built; a failure there must take them off again (a bf16 gradient hook
    left behind moved every later plain backward's .grad into myelin's carriers)."""

    def fail(*args, **kwargs):
        raise RuntimeError("the loop could not be built")

    monkeypatch.setattr(trainer_module, "EventLoop", fail)
    net = model()
    with pytest.raises(RuntimeError, match="the loop could not be built"):
        trainer(net, precision=precision, offload=BOTH)
    assert hooks_on(net) == []
    net.float()
    net(torch.randn(2, 16)).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_a_closed_trainer_and_its_host_pool_are_freed_without_a_collection():
    """Reference counting alone frees a closed trainer's host pool: no cycle holds it (the
    store held a bound method of its own, so the pool waited for a collection, and for
    ever where a trainer was dropped while its objects were frozen)."""
    t = trainer(offload=BOTH)
    step(t)
    t.close()
    assert t.pool is not None
    pool, store = weakref.ref(t.pool), weakref.ref(t._memory.activations)
    gc.disable()
    try:
        del t
        assert store() is None, gc.get_referrers(store())
        assert pool() is None
    finally:
        gc.enable()


def test_the_collector_freeze_is_left_as_the_user_had_it():
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with trainer() as t:
            for _ in range(collector.AFTER_STEPS):
                step(t)
        assert gc.get_freeze_count() > 0.9 * frozen  # not undone (a few frozen objects died)
    finally:
        gc.unfreeze()


def test_two_open_trainers_share_the_first_ones_freeze():
    with trainer() as first:
        for _ in range(collector.AFTER_STEPS):
            step(first)
        assert first._froze and gc.get_freeze_count() > 0
        second = trainer()
        for _ in range(collector.AFTER_STEPS):
            step(second)
        assert not second._froze  # objects were frozen already: it leaves them so
        first.close()
        assert gc.get_freeze_count() == 0  # the first undoes the freeze it made
        step(second)
        second.close()


class _Fails(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:  # the second step's first microbatch
            raise RuntimeError("the model failed")
        return x


@pytest.mark.parametrize("offload", [None, BOTH])
def test_a_trainer_whose_step_failed_is_freed_once_its_error_is_dropped(offload):
    """Reference counting alone frees it after close(): nothing of the trainer holds its
    error (whose traceback's frames hold the trainer), so a user who retries gets the
    memory back at once, not at the collector's next full pass."""
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), _Fails(), torch.nn.Linear(16, 4))
    t = trainer(net, offload=offload)
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="the model failed"):
            step(t)
            step(t)
        t.close()
        freed = weakref.ref(t)
        del t
        assert freed() is None, [type(r).__name__ for r in gc.get_referrers(freed())]
    finally:
        gc.enable()


def test_a_trainer_whose_constructor_failed_is_freed_once_its_error_is_dropped(monkeypatch):
    made = []

    class Kept(myelin.Trainer):
        def _build(self, *args):
            made.append(weakref.ref(self))
            super()._build(*args)

    def fail(*args, **kwargs):
        raise RuntimeError("the loop could not be built")

    monkeypatch.setattr(trainer_module, "EventLoop", fail)
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="the loop could not be built"):
            Kept(
                model(),
                functools.partial(torch.optim.AdamW, lr=1e-3),
                torch.nn.functional.cross_entropy,
                offload=BOTH,
            )
        assert made and made[0]() is None
    finally:
        gc.enable()
