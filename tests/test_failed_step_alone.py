"""A trainer of one rank forgets a step that failed before its update (a bad input, a loss
that raises, Ctrl-C): the error is raised, the model is as it was, and the next step trains
exactly as if the failed one had never been called."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import myelin

OFFLOADS = {
    "none": None,
    "activations": myelin.OffloadConfig(activations=True, min_bytes=0),
    "optimizer": myelin.OffloadConfig(optimizer=True),
}


def _trainer(offload: str, precision: str = "fp32", loss_fn=nn.functional.mse_loss):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    return myelin.Trainer(
        model, adam, loss_fn, microbatches=2, precision=precision, offload=OFFLOADS[offload]
    )


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _weights(trainer: myelin.Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.module.parameters()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_a_bad_microbatch_is_forgotten(offload, precision):
    batches = _batches(3)
    ref = _trainer(offload, precision)
    want = [ref.step(x, y) for x, y in batches]
    ref_weights = _weights(ref)
    ref.close()

    trainer = _trainer(offload, precision)
    try:
        got = [trainer.step(*batches[0])]
        before = _weights(trainer)
        x, y = batches[1]
        # the first microbatch runs forward and backward; the second has 9 features
        bad = [x[:4], torch.randn(4, 9)]
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            trainer.step(bad, [y[:4], y[4:]])
        assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), before, strict=True))
        assert trainer.steps_done == 1
        got += [trainer.step(x, y) for x, y in batches[1:]]
        assert got == want  # the first microbatch's gradients were dropped with the step
        for a, b in zip(_weights(trainer), ref_weights, strict=True):
            assert torch.equal(a, b)
        assert trainer.steps_done == 3
    finally:
        trainer.close()


def test_a_loss_that_raises_or_an_interrupt_is_forgotten():
    calls = {"n": 0, "raise_": None}

    def loss_fn(out, y):
        calls["n"] += 1
        if calls["raise_"] is not None and calls["n"] == 2:  # the step's second microbatch
            raise calls["raise_"]
        return nn.functional.mse_loss(out, y)

    batches = _batches(2)
    ref = _trainer("none")
    want = [ref.step(x, y) for x, y in batches]
    ref.close()
    trainer = _trainer("none", loss_fn=loss_fn)
    try:
        for error in (ValueError("bad target"), KeyboardInterrupt()):
            calls.update(n=0, raise_=error)
            with pytest.raises(type(error)):
                trainer.step(*batches[0])
        calls["raise_"] = None
        assert [trainer.step(x, y) for x, y in batches] == want
    finally:
        trainer.close()


def test_a_failed_evaluation_is_forgotten():
    batches = _batches(2)
    trainer = _trainer("none")
    try:
        trainer.step(*batches[0])
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            trainer.eval_step(torch.randn(8, 5), batches[1][1])
        assert trainer.module.training  # the model's mode is put back
        assert trainer.state_dict() is not None
        trainer.step(*batches[1])
    finally:
        trainer.close()


def test_a_step_that_failed_in_its_update_breaks_the_trainer():
    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)  # the weights have changed: no retry can undo that
            raise RuntimeError("the optimizer failed")

    torch.manual_seed(0)
    trainer = myelin.Trainer(
        nn.Linear(4, 2), functools.partial(Failing, lr=0.1), nn.functional.mse_loss
    )
    try:
        with pytest.raises(RuntimeError, match="the optimizer failed"):
            trainer.step(torch.randn(4, 4), torch.randn(4, 2))
        with pytest.raises(myelin.MyelinError, match="earlier step failed"):
            trainer.step(torch.randn(4, 4), torch.randn(4, 2))
    finally:
        trainer.close()


def test_a_step_refused_after_a_good_one_is_forgotten_too():
    """The flag that says the update began is reset before anything of a step can fail."""
    trainer = _trainer("none")
    try:
        x, y = _batches(1)[0]
        trainer.step(x, y)
        with pytest.raises(myelin.ConfigError, match="needs the targets"):
            trainer.step(x, None)
        trainer.step(x, y)
    finally:
        trainer.close()


def _bn_dropout_trainer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 4))
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    return myelin.Trainer(model, sgd, nn.functional.mse_loss, microbatches=2)


def test_running_statistics_and_random_streams_come_back_with_a_forgotten_step():
    batches = _batches(3)
    ref = _bn_dropout_trainer()
    want = [ref.step(x, y) for x, y in batches]
    ref_state = ref.state_dict()
    ref.close()
    trainer = _bn_dropout_trainer()
    try:
        got = [trainer.step(*batches[0])]
        x, y = batches[1]
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            trainer.step([x[:4], torch.randn(4, 9)], [y[:4], y[4:]])  # after mb 0's forward
        got += [trainer.step(x, y) for x, y in batches[1:]]
        assert got == want
        for k, v in trainer.state_dict().items():
            assert torch.equal(v, ref_state[k]), k
    finally:
        trainer.close()


def test_the_loss_scale_comes_back_with_a_forgotten_step():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    offload = myelin.OffloadConfig(
        optimizer=True, host_memory_limit="3MiB", slab_bytes="1MiB", bucket_bytes="300KiB"
    )
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    trainer = myelin.Trainer(model, adam, nn.functional.mse_loss, precision="fp16", offload=offload)
    try:
        before = trainer.updater.scaler.state_dict()
        for _ in range(2):  # Adam's state does not fit: the update never begins
            with pytest.raises(myelin.HostMemoryError):
                trainer.step(torch.randn(8, 256), torch.randn(8, 256))
        assert trainer.updater.scaler.state_dict() == before
    finally:
        trainer.close()


def test_an_argument_error_inside_a_with_block_is_not_a_pipeline_failure(tmp_path):
    """Every rank raises it alike: it is not told to the peers and the launcher as a
    failure (no flight record, no abort), as an error of the script's own is."""
    from myelin.failures import Failures

    failures = Failures(0, 2, tmp_path)
    failures.script_failed(myelin.ConfigError("fit: steps=0 must be an int >= 1"))
    assert failures.failed is None and not list(tmp_path.iterdir())
    failures.script_failed(RuntimeError("the script's own"))
    assert isinstance(failures.failed, RuntimeError)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the point)
def test_a_signal_python_swallowed_is_raised_when_the_next_step_begins(tmp_path, monkeypatch):
    """myelin run's Ctrl-C raised inside a weakref callback (the activation store's) is
    only printed by Python: the rank would train on. The next step raises it."""
    import signal
    import sys
    import weakref

    from myelin.failures import Failures

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the handler installs a quiet one
    failures = Failures(0, 2, tmp_path)

    class Held:
        pass

    held = Held()
    ref = weakref.ref(held, lambda _: failures._on_sigint(signal.SIGINT, None))
    del held  # the callback runs, raises, and Python swallows it
    assert ref() is None
    with pytest.raises(KeyboardInterrupt, match="rank 0 interrupted"):
        failures.enter("training step 2")
    failures.enter("training step 2")  # once


def test_a_rank_a_signal_stopped_among_peers_gathers_no_profile_at_close(tmp_path, monkeypatch):
    """A Ctrl-C that came through outside a step (between steps, or before an eval's
    guarded part) marks no failure, but the peers were stopped too: a gather at close
    would wait for them and log their errors as its own."""
    import signal
    import sys

    from myelin.failures import Failures

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    failures = Failures(0, 2, tmp_path)
    assert not failures.ending
    with pytest.raises(KeyboardInterrupt):
        failures._on_sigint(signal.SIGINT, None)
    assert failures.failed is None and not failures.ending  # one rank: its report is whole
    failures.transport = object()  # (peers to gather with)
    assert failures.ending


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the user's backward broke")


def test_the_users_own_error_is_raised_as_it_was_with_a_note_of_where():
    """The error is the user's own type and text, and a note says which action of which
    step (the trainer's count, from 1) it broke in; a second failure is noted once."""
    with _trainer("none") as t:
        x, y = _batches(1)[0]
        t.step(x, y)
        t.module[1].register_forward_hook(lambda m, i, out: _RaisesInBackward.apply(out))
        for _ in range(2):
            with pytest.raises(RuntimeError, match="the user's backward broke") as err:
                t.step(x, y)
            notes = [n for n in err.value.__notes__ if n.startswith("myelin:")]
            assert notes == [
                "myelin: rank 0 failed in running 0B0 (backward of microbatch 0) in training step 2"
            ]
