"""Trainer.fit and Trainer.evaluate over plain data loaders."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from myelin import Callback, ConfigError, ProfileConfig, Trainer

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


def test_eval_first_validates_before_the_first_step():
    loader = DataLoader(data(32), batch_size=16)
    with trainer() as t:
        before = t.evaluate(loader)
        history = t.fit(loader, eval_loader=loader, eval_first=True, log_every=4, progress=False)
        assert history[0] == {"step": 0, "val_loss": before}
        assert [row["step"] for row in history] == [0, 2]


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


class Recorder(Callback):
    """Every hook call, in order."""

    def __init__(self):
        self.calls = []

    def on_fit_start(self, trainer, first_step, last_step):
        self.calls.append(("start", first_step, last_step))

    def on_step_end(self, trainer, step, loss):
        self.calls.append(("step", step))

    def on_log(self, trainer, metrics):
        self.calls.append(("log", metrics["step"]))

    def on_checkpoint(self, trainer, path, step):
        self.calls.append(("checkpoint", step))

    def on_fit_end(self, trainer, history):
        self.calls.append(("end", len(history)))


def halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_fit_steps_the_lr_schedule_checkpoints_and_calls_every_hook(tmp_path):
    loader = DataLoader(data(), batch_size=8)
    rec = Recorder()
    with trainer() as t:
        history = t.fit(
            loader,
            steps=5,
            lr_schedule=halving,
            log_every=2,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=2,
            callbacks=[rec],
            progress=False,
        )
    assert [h["lr"] for h in history] == [0.5 / 2, 0.5 / 8, 0.5 / 16]  # lr each step ran at
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000005"
    shard = torch.load(tmp_path / "ckpt" / "step-00000005" / "rank0.pt", weights_only=True)
    assert shard["lr_scheduler"]["last_epoch"] == 5  # the scheduler goes with its stage
    assert rec.calls == [
        ("start", 0, 5),
        ("step", 1),
        ("log", 2),
        ("step", 2),
        ("checkpoint", 2),
        ("step", 3),
        ("log", 4),
        ("step", 4),
        ("checkpoint", 4),
        ("log", 5),
        ("step", 5),
        ("checkpoint", 5),
        ("end", 3),
    ]


def test_a_resumed_trainer_continues_the_schedule_and_the_step_numbers(tmp_path):
    loader = DataLoader(data(), batch_size=8)
    with trainer() as t:
        t.fit(loader, steps=3, lr_schedule=halving, checkpoint_dir=tmp_path, progress=False)
        # the schedule is the trainer's now: a later fit steps it on
        whole = t.fit(loader, steps=2, log_every=1, progress=False)
    torch.manual_seed(0)
    resumed = Trainer(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        SGD,
        F.cross_entropy,
        microbatches=2,
        resume=tmp_path,
    )
    with resumed:
        again = resumed.fit(loader, steps=2, lr_schedule=halving, log_every=1, progress=False)
    assert [h["step"] for h in again] == [4, 5] and resumed.steps_done == 5
    assert [h["lr"] for h in again] == [h["lr"] for h in whole] == [0.5 / 8, 0.5 / 16]
    assert [h["loss"] for h in again] == [h["loss"] for h in whole]


def test_a_time_budget_stops_training_and_tells_the_schedule_its_progress():
    seen = []

    class Progress(torch.optim.lr_scheduler.LambdaLR):
        def __init__(self, opt):
            self.progress = 0.0  # asks fit for the share of the run done
            super().__init__(opt, lambda step: 1.0)

        def step(self, epoch=None):
            seen.append(self.progress)
            super().step(epoch)

    with trainer() as t:
        history = t.fit(
            DataLoader(data(), batch_size=8),
            steps=100,
            max_seconds=1e-6,  # used up by the first step
            lr_schedule=Progress,
            progress=False,
        )
        assert t.steps_done == 1 and [h["step"] for h in history] == [1]
    assert seen[0] == 0.0 and seen[1] > 1.0  # built, then told: the time share, over 1


def test_a_resumed_time_budget_anneals_on_from_where_it_stopped(tmp_path, monkeypatch):
    """The time share counts the trainer's time before the fit (checkpointed), so a run
    resumed with what is left of its budget goes on from its share, not from 0."""
    clock = {"now": 0.0}

    def tick():  # every reading of the clock is one second later
        clock["now"] += 1.0
        return clock["now"]

    seen = []

    class Progress(torch.optim.lr_scheduler.LambdaLR):
        def __init__(self, opt):
            self.progress = 0.0
            super().__init__(opt, lambda step: 1.0)

        def step(self, epoch=None):
            seen.append(self.progress)
            super().step(epoch)

    monkeypatch.setattr("myelin.fit.time.monotonic", tick)
    loader = DataLoader(data(), batch_size=8)
    with trainer() as t:  # 4 steps of a 1000 s budget, then a checkpoint
        t.fit(loader, steps=4, max_seconds=1000, progress=False, checkpoint_dir=tmp_path)
        spent = t.seconds_trained
    assert 4 <= spent < 100  # (every reading of the clock, anywhere, ticks)
    with Trainer(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        SGD, F.cross_entropy, microbatches=2, resume=tmp_path,
    ) as resumed:  # fmt: skip
        assert resumed.seconds_trained == spent
        resumed.fit(loader, steps=10_000, max_seconds=1000 - spent, lr_schedule=Progress,
                    progress=False)  # fmt: skip  # (stops when the 1000 s are used)
        assert 1000 <= resumed.seconds_trained < 1100
    share = seen[1]  # the first step's: (spent + its time) / 1000, not its time alone
    assert spent / 1000 < share < (spent + 100) / 1000


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_seconds": 0}, "max_seconds=0 must be > 0"),
        ({"max_seconds": "1"}, "max_seconds='1' must be a number of seconds"),
        ({"checkpoint_every": 2}, "checkpoint_every needs a checkpoint_dir"),
        ({"checkpoint_dir": "c", "checkpoint_every": 0}, "checkpoint_every=0 must be an int"),
        ({"lr_schedule": 0.1}, "lr_schedule=0.1 must be a function of the optimizer"),
        ({"callbacks": [3]}, "callbacks: 3 is neither a myelin.Callback nor a function"),
        ({"uneven": "longest"}, "uneven='longest' must be one of shortest, raise"),
        ({"callbacks": print}, "callbacks=<built-in function print> must be a list"),
        ({"eval_first": True}, "eval_first=True needs an eval_loader"),
        ({"eval_loader": [], "eval_batches": 0}, "eval_batches=0 must be an int >= 1"),
        ({"eval_loader": [], "eval_batches": "2"}, "eval_batches='2' must be an int >= 1"),
        ({"lr_schedule": lambda o: None}, "returned None, not an LR scheduler"),
        (
            {"lr_schedule": torch.optim.lr_scheduler.ReduceLROnPlateau},
            "returned ReduceLROnPlateau, which steps on a metric",
        ),
    ],
)
def test_bad_new_fit_arguments_are_named(kwargs, message):
    """Named before the first step (the loader has batches: none trains)."""
    with trainer() as t, pytest.raises(ConfigError, match=message):
        t.fit(DataLoader(data(), batch_size=8), progress=False, **kwargs)
    assert t.steps_done == 0


def test_callbacks_may_be_any_iterable_of_callbacks():
    seen = []
    with trainer() as t:
        t.fit(DataLoader(data(), batch_size=8), steps=2, log_every=1, progress=False,
              callbacks=collections.deque([lambda tr, row: seen.append(row["step"])]))  # fmt: skip
    assert seen == [1, 2]


@pytest.mark.parametrize("max_batches", [0, -1, 1.5])
def test_evaluate_names_a_bad_max_batches(max_batches):
    with trainer() as t, pytest.raises(ConfigError, match=f"max_batches={max_batches!r} must be"):
        t.evaluate(DataLoader(data(), batch_size=8), max_batches=max_batches)


def test_a_failed_step_is_named_by_its_number():
    x, y = next(iter(DataLoader(data(), batch_size=8)))
    with trainer() as t:
        t.step(x, y)
        with pytest.raises(RuntimeError):
            t.step(torch.randn(8, 3), y)
        assert "failed in training step 2" in t._failures.flight.summary()


def test_the_time_budgets_agreement_is_recorded_as_step_end_sync():
    """fit's per-step all-reduce of the time used waits for the rank that ends the step last:
    a `sync` wait of the step it follows, not host overhead (issue 11.4)."""
    loader = DataLoader(data(32), batch_size=8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with Trainer(model, SGD, F.cross_entropy, microbatches=2, profile=True) as t:
        t.fit(loader, steps=3, max_seconds=600, progress=False)
        agreed = [s for s in t.timeline.spans if s.name == "0SYNC_FIT"]
        ops = {s.step for s in t.timeline.spans if s.kind == "forward"}
    assert [s.step for s in agreed] == sorted(ops) == [0, 1, 2]
    assert all(s.kind == "allreduce" and s.cause == "sync" for s in agreed)


def test_a_trainer_keeps_what_it_built_out_of_the_garbage_collectors_scans():
    """Full collections over torch's objects stalled steps by tens of ms (issue 11.4): the
    trainer freezes what lives once it has run AFTER_STEPS steps (one that never steps never
    pays the full collection that starts a freeze), and close() gives it back."""
    import gc

    from myelin import collector

    assert gc.get_freeze_count() == 0
    with trainer() as t:
        for _ in range(collector.AFTER_STEPS - 1):
            t.step(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
        assert gc.get_freeze_count() == 0
        t.step(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
        assert gc.get_freeze_count() > 0
        t.step(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    assert gc.get_freeze_count() == 0


def test_a_profiled_trainer_freezes_at_the_end_of_the_profilers_warm_up():
    """The steady state a profile measures has no full collection in it (they skewed the op
    times a profile replays): the freeze comes after the warm-up, not after AFTER_STEPS."""
    import gc

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with Trainer(net, SGD, F.cross_entropy, profile=ProfileConfig(warmup_steps=2)) as t:
        t.step(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
        assert gc.get_freeze_count() == 0
        t.step(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_only_the_one_that_froze_unfreezes():
    """A trainer whose build failed (it froze nothing) leaves a freeze it did not make."""
    import gc

    from myelin import collector

    gc.freeze()
    try:
        collector.unfreeze(False)
        assert gc.get_freeze_count() > 0
        assert collector.freeze() is False  # frozen already (the user, another trainer)
        collector.unfreeze(False)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert collector.freeze() is True
    collector.unfreeze(True)
    assert gc.get_freeze_count() == 0


def test_a_loader_without_len_still_ends_with_validation_a_row_and_a_checkpoint(tmp_path):
    batches = list(DataLoader(data(40), batch_size=8))

    def one_pass():
        yield from batches

    with trainer() as t:
        history = t.fit(
            one_pass(),
            epochs=1,
            eval_loader=batches[:2],
            log_every=100,
            checkpoint_dir=tmp_path / "ck",
            progress=False,
        )
    assert [row["step"] for row in history] == [5] and "val_loss" in history[0]
    assert (tmp_path / "ck" / "latest").read_text() == "step-00000005"


def test_a_one_shot_loader_shorter_than_steps_says_so():
    batches = list(DataLoader(data(24), batch_size=8))
    with trainer() as t, pytest.raises(ConfigError, match="ran out after 3 of steps=5.*one-shot"):
        t.fit((b for b in batches), steps=5, progress=False)


def test_epochs_over_a_one_shot_loader_say_so():
    """A generator is passed over once: epochs=2 over it trained one epoch without a word."""
    batches = list(DataLoader(data(24), batch_size=8))
    with trainer() as t:
        with pytest.raises(ConfigError, match="epochs=2 over a one-shot iterator"):
            t.fit((b for b in batches), epochs=2, progress=False)
        assert t.steps_done == 0

        class Once:  # an iterable that is no iterator, but gives its batches once
            def __init__(self):
                self.left = iter(batches)

            def __iter__(self):
                return self.left

        with pytest.raises(ConfigError, match="no batches on its pass 2 of epochs=2"):
            t.fit(Once(), epochs=2, progress=False)


@pytest.mark.parametrize("epochs", [1, 3])
def test_an_empty_loader_is_an_error_not_a_silent_return(epochs):
    with trainer() as t, pytest.raises(ConfigError, match="gave no batches"):
        t.fit([], epochs=epochs, progress=False)


def test_a_run_resumed_for_more_steps_goes_on_at_the_longer_schedules_rate(tmp_path):
    """WarmupCosine over 6 steps, resumed for 6 more: from step 7 the rates are a 12-step
    run's (step 7 ran at the 6-step schedule's floor, which its last step had set)."""
    from myelin.lr import WarmupCosine

    def schedule(opt):
        return WarmupCosine(opt, warmup_steps=2, floor=0.1)

    loader = DataLoader(data(), batch_size=8)
    with trainer() as t:
        whole = t.fit(loader, steps=12, lr_schedule=schedule, log_every=1, progress=False)
    with trainer() as t:
        t.fit(loader, steps=6, lr_schedule=schedule, checkpoint_dir=tmp_path, progress=False)
    torch.manual_seed(0)
    resumed = Trainer(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), SGD,
                      F.cross_entropy, microbatches=2, resume=tmp_path)  # fmt: skip
    with resumed:
        again = resumed.fit(loader, steps=6, lr_schedule=schedule, log_every=1, progress=False)
    assert [h["step"] for h in again] == list(range(7, 13))
    assert [h["lr"] for h in again] == [h["lr"] for h in whole[6:]]
