"""Hogbatch through the Trainer's strategy slot: `Trainer(..., sync=myelin.Hogbatch(...))`.

    python -m pytest -q tests/replicas/test_hogbatch_trainer.py    # ~15 s on 2 loaded cores

The config errors need no worker; the two runs spawn one and three worker processes.
"""

from __future__ import annotations

import copy
import functools
import gc
import shutil

import pytest
import torch

import myelin
from myelin.errors import ConfigError
from myelin.profile.report import ProfileConfig
from myelin.replicas.hogbatch_dispatch import Dispatcher
from tests.replicas._problem import problem


def flat(state):
    return torch.cat([v.reshape(-1) for v in state.values()])


SGD = functools.partial(torch.optim.SGD, lr=0.05, weight_decay=0.01)


def test_lock_with_one_worker_is_plain_sgd_bit_for_bit_and_a_checkpoint_resumes(tmp_path):
    model, data, _ = problem()
    ref = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    ref.load_state_dict(model.state_dict())
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(48, 48), adaptive=False, lock=True,
                          timeout_s=100)  # fmt: skip
    profile = ProfileConfig(print_summary=False)
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=hog, profile=profile) as trainer:
        assert trainer.replicas.batch_sizes == {"device": 48, "cpu": 4}
        rows = trainer.fit(data, epochs=1, checkpoint_dir=tmp_path / "ck")
        first = trainer.state_dict()
        assert trainer.steps_done == 11 and [r["epoch"] for r in rows] == [0]  # 10 x 48 + 32
        assert rows[-1]["hogbatch"]["workers"][0]["share"] == 1.0
        assert trainer.evaluate([data]) == pytest.approx(rows[-1]["loss"], rel=1e-6)
        # the profiler's summary and trace carry the run's figures and tracks
        (rank,) = trainer.profile_report().summary()["ranks"]
        assert rank["detail"]["hogbatch"]["workers"][0]["updates"] == 11
        assert [b for _, b in trainer.timeline.counters["hogbatch device batch"]] == [48]
        assert len(trainer.timeline.counters["hogbatch epoch loss"]) == 1
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    with myelin.Trainer(fresh, SGD, torch.nn.MSELoss(), sync=hog, resume=tmp_path / "ck") as t2:
        assert torch.equal(flat(t2.state_dict()), flat(first)) and t2.steps_done == 11
        assert t2.replicas.state_dict()["epoch"] == 1  # the rule's state and the next epoch
        rows = t2.fit(data, epochs=1)
        assert [r["epoch"] for r in rows] == [1] and rows[-1]["step"] == 22
        final = t2.state_dict()
    # the same batches (each epoch's permutation in ranges of 48) through torch.optim.SGD
    sgd = SGD(ref.parameters())
    perms = Dispatcher(len(data[0]), 2, hog.seed)
    for epoch in (0, 1):
        order = perms.permutation(epoch)
        for start in range(0, len(order), 48):
            idx = order[start : start + 48]
            sgd.zero_grad()
            torch.nn.MSELoss()(ref(data[0][idx]), data[1][idx]).backward()
            sgd.step()
    assert torch.equal(flat(final), flat(ref.state_dict()))


def test_the_profile_summary_counts_every_fit_as_its_tracks_do():
    model, data, _ = problem(n=96)
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(32, 32), adaptive=False, timeout_s=100)
    profile = ProfileConfig(print_summary=False)
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=hog, profile=profile) as trainer:
        trainer.fit(data, epochs=2)
        trainer.fit(data, epochs=1)  # its rows and stats() are this fit's alone
        assert trainer.replicas.stats()["workers"][0]["updates"] == 3
        (rank,) = trainer.profile_report().summary()["ranks"]
        tracks = trainer.timeline.counters
    detail = rank["detail"]["hogbatch"]
    assert detail["fits"] == 2 and detail["workers"][0]["updates"] == trainer.steps_done == 9
    assert detail["workers"][0]["samples"] == 3 * 96 and detail["workers"][0]["share"] == 1.0
    assert detail["device_batch"] == tracks["hogbatch device batch"]  # both fits, trace clock
    assert len(tracks["hogbatch epoch loss"]) == 3


def test_progress_is_a_bar_of_epochs(capsys):
    model, data, _ = problem(n=64)
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(32, 32), adaptive=False, timeout_s=100)
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=hog) as trainer:
        trainer.fit(data, epochs=2, progress=False)
        assert "epoch" not in capsys.readouterr().err
        rows = trainer.fit(data, epochs=2)  # progress=True, the default: it was ignored
    err = capsys.readouterr().err
    assert "2/2" in err and "epoch" in err and f"loss={rows[-1]['loss']:.4g}" in err


def test_lock_free_run_reaches_the_optimum_and_reports_its_counters(tmp_path):
    model, data, best = problem(n=1024)
    hog = myelin.Hogbatch(cpu_workers=2, cpu_batch=4, device_batch=(32, 256), budget=0.5,
                          timeout_s=100)  # fmt: skip
    logged, frozen = [], []
    with myelin.Trainer(model, functools.partial(torch.optim.SGD, lr=0.05), torch.nn.MSELoss(),
                        sync=hog) as trainer:  # fmt: skip
        rows = trainer.fit(torch.utils.data.TensorDataset(*data), epochs=12, eval_loader=data,
                           callbacks=[lambda t, row: logged.append(row)
                                      or frozen.append(gc.get_freeze_count())],
                           checkpoint_dir=tmp_path, checkpoint_every=4)  # fmt: skip
        final = trainer.state_dict()
        got = flat(final).double()
        stats = trainer.replicas.stats()
        steps = trainer.steps_done
    # checkpoints taken while the workers ran (every 4 epochs), then the last one
    assert len([d for d in tmp_path.iterdir() if d.name.startswith("step-")]) >= 2
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    with myelin.Trainer(fresh, SGD, torch.nn.MSELoss(), sync=hog, resume=tmp_path) as again:
        assert again.steps_done == steps and torch.equal(flat(again.state_dict()), flat(final))
        assert again.replicas.state_dict()["epoch"] == 12
    assert sorted(r["epoch"] for r in rows) == list(range(12)) and logged == rows  # as completed
    # the runner's loop is the trainer's long run: out of the collector's scans until close
    assert len(frozen) == 12 and all(frozen) and gc.get_freeze_count() == 0
    assert all("val_loss" in r for r in rows) and rows[-1]["val_loss"] < rows[0]["val_loss"]
    assert (got - best).norm() / best.norm() < 0.01
    workers = stats["workers"]
    assert [w["worker"] for w in workers] == ["device", "cpu1", "cpu2"]
    assert all(w["updates"] > 0 for w in workers)
    assert sum(w["samples"] for w in workers) == 12 * 1024  # each sample once per epoch
    assert abs(sum(w["share"] for w in workers) - 1) < 1e-9
    assert all(0 <= w["tau_median"] <= w["tau_p99"] and 0 < w["busy"] <= 1.05 for w in workers)
    assert stats["device_batch"][0] == (0.0, 256) and rows[-1]["hogbatch"] == stats


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"stages": 2}, "stages"),
        ({"data_parallel": 2}, "data_parallel"),
        ({"offload": myelin.OffloadConfig(activations=True)}, "offload"),
        ({"precision": "bf16"}, "precision"),
        ({"max_grad_norm": 1.0}, "max_grad_norm"),
        ({"microbatches": 4}, "microbatches"),  # was accepted, and ignored
    ],
)
def test_combinations_that_make_no_sense_name_the_field(kw, field):
    model, _, _ = problem()
    with pytest.raises(ConfigError, match=rf"Trainer\({field}=.*sync=Hogbatch"):
        myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=myelin.Hogbatch(), **kw)


@pytest.mark.parametrize(
    "opt, words",
    [
        (torch.optim.Adam, "Adam"),
        (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), "momentum=0.9"),
    ],
)
def test_stateful_optimizers_are_refused_when_built_with_the_reason(opt, words):
    model, _, _ = problem()
    with pytest.raises(ConfigError, match=words) as e:
        myelin.Trainer(model, opt, torch.nn.MSELoss(), sync="hogbatch")
    assert "shared model without locks" in str(e.value)


def test_step_steps_and_loaders_are_refused_before_any_worker_starts():
    model, data, _ = problem()
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=myelin.Hogbatch()) as trainer:
        with pytest.raises(ConfigError, match=r"Trainer.step under sync=Hogbatch.*fit\(dataset"):
            trainer.step(*data)
        with pytest.raises(ConfigError, match=r"fit\(steps=5\) under sync=Hogbatch"):
            trainer.fit(data, steps=5)
        with pytest.raises(ConfigError, match=r"fit\(log_every=5\) under sync=Hogbatch.*epoch"):
            trainer.fit(data, log_every=5)  # was ignored: a row per epoch
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data), 32)
        with pytest.raises(ConfigError, match="not a DataLoader"):
            trainer.fit(loader)
        assert trainer.steps_done == 0


def _sgd_epochs(model, data, epochs, batch, seed):
    """`model` after `epochs` of SGD over each epoch's permutation in ranges of `batch`."""
    sgd = SGD(model.parameters())
    perms = Dispatcher(len(data[0]), epochs, seed)
    for epoch in range(epochs):
        order = perms.permutation(epoch)
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            sgd.zero_grad()
            torch.nn.MSELoss()(model(data[0][idx]), data[1][idx]).backward()
            sgd.step()
    return flat(model.state_dict())


def _fresh(model):
    out = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    out.load_state_dict(model.state_dict())
    return out


class _Keep(myelin.Callback):
    """Copies the first checkpoint, and checks what callbacks see at each epoch's row."""

    def __init__(self, dst, w0):
        self.dst, self.w0, self.rows = dst, w0, []

    def on_log(self, trainer, metrics):
        # the trainer's model has moved with its steps (not the weights before fit)
        self.rows.append((trainer.steps_done, torch.equal(flat(trainer.state_dict()), self.w0)))

    def on_checkpoint(self, trainer, path, step):
        if not self.dst.exists():
            shutil.copytree(path, self.dst)
            self.first = step


def test_a_checkpoint_taken_during_fit_resumes_exactly(tmp_path):
    """The workers run ahead into the next epoch while an epoch's checkpoint is taken: its
    weights, steps and the samples they hold are one instant, and a resume trains each
    other sample once (lock, one worker: the uninterrupted run and SGD, bit for bit)."""
    model, data, _ = problem(n=70)
    w0, ref = flat(model.state_dict()), _fresh(model)
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(8, 8), adaptive=False, lock=True,
                          timeout_s=100, emulate=((0.002, 0.0), (0.0, 0.0)))  # fmt: skip
    keep = _Keep(tmp_path / "first", w0)
    with myelin.Trainer(_fresh(model), SGD, torch.nn.MSELoss(), sync=hog) as t:
        t.fit(data, epochs=3, checkpoint_dir=tmp_path / "ck", checkpoint_every=1,
              callbacks=[keep])  # fmt: skip
        whole = flat(t.state_dict())
        assert t.steps_done == 27  # 3 x 9 ranges (8 x 8 + 6)
    assert [w0_seen for _, w0_seen in keep.rows] == [False, False, False]
    assert keep.first >= 9  # epoch 0's 9 updates, and any of epoch 1's landed by then
    assert torch.equal(whole, _sgd_epochs(ref, data, 3, 8, hog.seed))
    with myelin.Trainer(_fresh(model), SGD, torch.nn.MSELoss(), sync=hog,
                        resume=tmp_path / "first") as t2:  # fmt: skip
        assert t2.steps_done == keep.first
        t2.fit(data, epochs=2)
        assert torch.equal(flat(t2.state_dict()), whole) and t2.steps_done == 27


class _Fail(myelin.Callback):
    def on_log(self, trainer, metrics):
        raise RuntimeError("a callback failed")


def test_a_fit_that_fails_keeps_what_was_trained_and_a_retry_continues(tmp_path):
    """After a failure in the middle of fit, the trainer holds the workers' weights with the
    steps and samples they hold; fit again trains the rest, each sample once."""
    model, data, _ = problem(n=70)
    w0, ref = flat(model.state_dict()), _fresh(model)
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(8, 8), adaptive=False, lock=True,
                          timeout_s=100, emulate=((0.002, 0.0), (0.0, 0.0)))  # fmt: skip
    with myelin.Trainer(_fresh(model), SGD, torch.nn.MSELoss(), sync=hog) as t:
        with pytest.raises(RuntimeError, match="a callback failed"):
            t.fit(data, epochs=3, callbacks=[_Fail()])
        assert t.steps_done >= 9 and not torch.equal(flat(t.state_dict()), w0)
        # the first row comes when its evaluation (a thread) is over: 1 or more epochs in
        done = t.replicas.state_dict()["epoch"]
        assert done >= 1 and t.steps_done >= 9 * done
        if done < 3:
            t.fit(data, epochs=3 - done)
        assert t.steps_done == 27
        assert torch.equal(flat(t.state_dict()), _sgd_epochs(ref, data, 3, 8, hog.seed))
    with pytest.raises(myelin.MyelinError, match="closed"):
        t.fit(data, epochs=1)  # closed: nothing starts


def test_a_sparse_embedding_trains_as_sgd_does():
    """torch.optim.SGD takes an Embedding(sparse=True)'s gradients; so do the workers. And
    eval_first's row is the loss before training."""
    torch.manual_seed(0)
    x, y = torch.randint(0, 50, (64, 3)), torch.randn(64)
    net = torch.nn.Sequential(torch.nn.Embedding(50, 4, sparse=True), torch.nn.Flatten(1),
                              torch.nn.Linear(12, 1), torch.nn.Flatten(0))  # fmt: skip
    ref = copy.deepcopy(net)
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(16, 16), adaptive=False, lock=True,
                          timeout_s=100)  # fmt: skip
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    with myelin.Trainer(net, opt, torch.nn.MSELoss(), sync=hog) as t:
        before = t.evaluate([(x, y)])
        rows = t.fit((x, y), epochs=1, eval_first=True)  # a row of the loss before training
        got = flat(t.state_dict())
    assert rows[0] == {"step": 0, "loss": pytest.approx(before, rel=1e-6)}
    assert rows[1]["epoch"] == 0 and rows[1]["step"] == 4
    sgd = opt(ref.parameters())
    order = Dispatcher(64, 1, hog.seed).permutation(0)
    for start in range(0, 64, 16):
        idx = order[start : start + 16]
        sgd.zero_grad()
        torch.nn.MSELoss()(ref(x[idx]), y[idx]).backward()
        sgd.step()
    torch.testing.assert_close(got, flat(ref.state_dict()))


def test_a_loss_the_workers_cannot_receive_is_refused_before_any_start():
    model, data, _ = problem(n=16)
    with myelin.Trainer(model, SGD, lambda o, t: (o - t).pow(2).mean(), sync="hogbatch") as t:
        with pytest.raises(ConfigError, match="cannot be sent to the spawned worker processes"):
            t.fit(data)
        assert t.steps_done == 0


def test_a_second_fit_on_other_data_is_one_epoch_of_it(tmp_path):
    """A fit that ended at an epoch's end leaves no position for the next: a later fit on
    another dataset trains each of its samples once per epoch (it finished "epoch 0" from
    position 600 of the new data: 1400 samples for one epoch of 1000)."""
    model, data, _ = problem(n=1000)
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(8, 8), adaptive=False, lock=True,
                          timeout_s=100)  # fmt: skip
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=hog) as t:
        t.fit((data[0][:600], data[1][:600]), epochs=1)
        assert t.steps_done == 75
        rows = t.fit(data, epochs=1)
        (device,) = rows[-1]["hogbatch"]["workers"]
        assert (device["updates"], device["samples"]) == (125, 1000)
        assert [r["epoch"] for r in rows] == [1]


def test_a_resumed_run_checks_the_checkpoint_against_its_data_and_settings(tmp_path):
    """Trainer(resume=) under Hogbatch checks the run's state as Hogbatch.fit(resume=) does:
    a run stopped mid-epoch cannot finish that epoch on a dataset of another size; fixed
    Hogbatch trains at its own batch whatever the checkpoint's rule chose."""
    model, data, _ = problem(n=600)
    adaptive = myelin.Hogbatch(cpu_workers=0, device_batch=(8, 64), adaptive=True, budget=0.5,
                               lock=True, timeout_s=100)  # fmt: skip
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=adaptive) as t:
        # stopped by the time limit at once: the ranges in flight land, epoch 0 unfinished
        t.fit(data, epochs=3, max_seconds=1e-9)
        t.save(tmp_path / "ck")
        state = t.replicas.state_dict()
    assert state["progress"]["samples"] == 600
    assert state["epoch"] == 0 and state["progress"]["epoch"] == 0
    assert 0 < state["progress"]["cursor"] < 600  # mid-epoch
    small = (data[0][:100], data[1][:100])
    with myelin.Trainer(problem(n=600)[0], SGD, torch.nn.MSELoss(), sync=adaptive,
                        resume=tmp_path / "ck") as t:  # fmt: skip
        with pytest.raises(ConfigError, match="dataset of 600 samples, and this one has 100"):
            t.fit(small, epochs=1)
    fixed = myelin.Hogbatch(cpu_workers=0, device_batch=(32, 32), adaptive=False, lock=True,
                            timeout_s=100)  # fmt: skip
    with myelin.Trainer(problem(n=600)[0], SGD, torch.nn.MSELoss(), sync=fixed,
                        resume=tmp_path / "ck") as t:  # fmt: skip
        rows = t.fit(data, epochs=1)
        assert t.replicas.batch_sizes["device"] == 32
        assert {b for _, b in rows[-1]["hogbatch"]["device_batch"]} == {32}
    narrow = myelin.Hogbatch(cpu_workers=0, device_batch=(100, 200), adaptive=True, lock=True,
                             timeout_s=100)  # fmt: skip
    with myelin.Trainer(problem(n=600)[0], SGD, torch.nn.MSELoss(), sync=narrow,
                        resume=tmp_path / "ck") as t:  # fmt: skip
        with pytest.raises(ConfigError, match=r"outside device_batch=\(100, 200\)"):
            t.fit(data, epochs=1)


def test_max_seconds_stops_mid_epoch_and_the_next_fit_finishes_that_epoch():
    """fit(max_seconds=) is checked at every update, not only as an epoch completes: an
    epoch of 32 updates of 50 ms stops after about 0.5 s with a row of where it stopped,
    and the next fit trains each sample left exactly once."""
    model, data, _ = problem()
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(16, 16), adaptive=False, lock=True,
                          emulate=((0.05, 0.0), (0.0, 0.0)), timeout_s=100)  # fmt: skip
    with myelin.Trainer(model, SGD, torch.nn.MSELoss(), sync=hog) as trainer:
        rows = trainer.fit(data, epochs=5, max_seconds=0.5)
        (row,) = rows
        assert "epoch" not in row and 0 < row["epochs"] < 1 and row["wall_s"] < 1.5
        assert row["loss"] == pytest.approx(trainer.evaluate([data]), rel=1e-6)
        assert 0 < trainer.steps_done < 32
        rows = trainer.fit(data, epochs=1)
        assert [r["epoch"] for r in rows] == [0] and trainer.steps_done == 32  # 512 / 16
    with pytest.raises(ConfigError, match="max_seconds"):
        hog.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), data,
                max_seconds=0)  # fmt: skip
