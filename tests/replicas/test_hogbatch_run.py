"""Hogbatch's runner with real worker processes (myelin/replicas/hogbatch_run.py).

    python -m pytest -q tests/replicas/test_hogbatch_run.py            # ~1 min on 2 loaded cores
    python -m pytest -q -m slow tests/replicas/test_hogbatch_run.py    # + lock-free, faults

Each run spawns its workers (starting them is most of the time); every wait in the runner
has `timeout_s`, and every test bounds its own run too.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch

import myelin
from myelin.errors import ConfigError, PeerLostError
from myelin.replicas.hogbatch_dispatch import Dispatcher
from myelin.replicas.hogbatch_rule import Controller
from myelin.replicas.hogbatch_store import load_flat
from tests.replicas._problem import problem


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_records(path: Path):
    recs = []
    for f in sorted(path.glob("worker*.pt")):
        w = int(f.stem[len("worker") :])
        recs += [{**r, "worker": w} for r in torch.load(f)]
    return sorted(recs, key=lambda r: r["version"])


@pytest.mark.parametrize(
    "opt, words",
    [
        (lambda p: torch.optim.Adam(p), "Adam"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "momentum=0.9"),
    ],
)
def test_stateful_optimizers_are_refused_with_the_reason(opt, words):
    model, data, _ = problem()
    with pytest.raises(ConfigError, match=words) as e:
        myelin.Hogbatch().fit(model, opt(model.parameters()), torch.nn.MSELoss(), data)
    assert "shared model without locks" in str(e.value)


def test_an_optimizer_over_part_of_the_model_is_refused_not_ignored():
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    data = (torch.randn(16, 5), torch.randint(0, 3, (16,)))
    loss = torch.nn.functional.cross_entropy
    only_last = torch.optim.SGD(model[2].parameters(), lr=0.1)  # meant to freeze the rest
    with pytest.raises(ConfigError, match="leaves out 2 of the model's 4 trainable.*requires_grad"):
        myelin.Hogbatch(cpu_workers=0).fit(model, only_last, loss, data)
    with pytest.raises(ConfigError, match="leaves out 2"):
        myelin.Trainer(model, lambda p: torch.optim.SGD(list(p)[2:], lr=0.1), loss,
                       sync=myelin.Hogbatch(cpu_workers=0))  # fmt: skip
    for p in model[0].parameters():  # frozen as the error says: accepted, and left alone
        p.requires_grad_(False)
    w0 = model[0].weight.detach().clone()
    myelin.Hogbatch(cpu_workers=0, device_batch=(8, 8), adaptive=False, lock=True).fit(
        model, only_last, loss, data, epochs=1
    )
    assert torch.equal(model[0].weight, w0)


def test_a_model_with_running_statistics_is_refused_naming_the_module():
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)
    )
    data = (torch.randn(16, 5), torch.randint(0, 3, (16,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy
    with pytest.raises(ConfigError, match="module '1' \\(BatchNorm1d\\) keeps running statistics"):
        myelin.Hogbatch(cpu_workers=0).fit(model, opt, loss, data)
    trainer = myelin.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), loss,
                             sync=myelin.Hogbatch(cpu_workers=0))  # fmt: skip
    with trainer, pytest.raises(ConfigError, match="BatchNorm1d"):
        trainer.fit(torch.utils.data.TensorDataset(*data), epochs=1)
    model[1] = torch.nn.BatchNorm1d(8, track_running_stats=False)  # accepted
    myelin.Hogbatch(cpu_workers=0, device_batch=(8, 8), adaptive=False).fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss, data, epochs=1
    )


@pytest.mark.parametrize(
    "loss",
    [
        torch.nn.MSELoss(reduction="sum"),
        functools.partial(torch.nn.functional.mse_loss, reduction="none"),
    ],
)
def test_a_loss_that_is_not_its_batchs_mean_is_refused(loss):
    model, data, _ = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="reduction='(sum|none)'.*mean over its batch"):
        myelin.Hogbatch(cpu_workers=0).fit(model, opt, loss, data)


def test_a_float64_model_is_said_to_train_as_fp32(caplog):
    from myelin.replicas.hogbatch_strategy import check_model

    check_model(torch.nn.Linear(2, 2))
    assert "float64" not in caplog.text
    check_model(torch.nn.Linear(2, 2).double())  # the one shared copy is fp32
    assert "float64 parameters train as fp32" in caplog.text


def test_a_parametrized_model_trains_as_sgd_does_and_spectral_norm_is_refused():
    from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

    def make():  # torch refuses to pickle these modules; the workers get them all the same
        torch.manual_seed(0)
        return torch.nn.Sequential(weight_norm(torch.nn.Linear(5, 8)), torch.nn.Tanh(),
                                   orthogonal(torch.nn.Linear(8, 8)), torch.nn.Linear(8, 1),
                                   torch.nn.Flatten(0))  # fmt: skip

    model, ref = make(), make()
    data = (torch.randn(64, 5), torch.randn(64))
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(16, 16), adaptive=False, lock=True)
    hog.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), data)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    order = Dispatcher(64, 1, hog.seed).permutation(0)
    for start in range(0, 64, 16):
        idx = order[start : start + 16]
        sgd.zero_grad()
        torch.nn.MSELoss()(ref(data[0][idx]), data[1][idx]).backward()
        sgd.step()
    got, want = model.state_dict(), ref.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    model[2] = spectral_norm(torch.nn.Linear(8, 8))  # its u, v would stay in each worker
    with pytest.raises(ConfigError, match="module '2' \\(Linear\\) has spectral_norm"):
        hog.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), data)


def test_the_epoch_loss_is_evaluated_in_eval_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 3)
    )
    data = (torch.randn(64, 5), torch.randint(0, 3, (64,)))
    loss = torch.nn.functional.cross_entropy
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = myelin.Hogbatch(cpu_workers=0, device_batch=(16, 16), adaptive=False).fit(
        model, opt, loss, data, epochs=1
    )
    with torch.no_grad():  # the model ends holding the weights the last evaluation saw
        expected = float(loss(model.eval()(data[0]), data[1]))
    assert report["evals"][-1]["loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"budget": 1.5}, "budget"),
        ({"ratio": 0}, "ratio"),
        ({"device_batch": (64, 8)}, "device_batch"),
        ({"cpu_batch": 0}, "cpu_batch"),
        ({"on_worker_loss": "ignore"}, "on_worker_loss"),
        ({"max_staleness": 0}, "max_staleness"),
        ({"emulate": (1.0, 2.0)}, "emulate"),
        ({"device": "tpu"}, "device"),
        ({"lock": "no"}, "lock"),
        ({"adaptive": 1}, "adaptive"),
        ({"record": 5}, "record"),
    ],
)
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=rf"Hogbatch\({field}="):
        myelin.Hogbatch(**kw)


def test_fit_takes_a_tensor_dataset_and_checks_eval_data_before_any_worker_starts():
    model, (x, y), _ = problem(n=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hog = myelin.Hogbatch(cpu_workers=0, device_batch=(32, 32), adaptive=False)
    bad = [
        ({"data": torch.utils.data.TensorDataset(x)}, r"Hogbatch.fit\(data=...\)"),
        ({"data": (x, y[:10])}, r"Hogbatch.fit\(data=...\)"),
        ({"eval_data": torch.utils.data.TensorDataset(x)}, r"Hogbatch.fit\(eval_data=...\)"),
        ({"eval_data": (x, y[:3])}, r"Hogbatch.fit\(eval_data=...\)"),
    ]
    for kw, words in bad:
        args = {"data": (x, y), **kw}
        with pytest.raises(ConfigError, match=words):
            hog.fit(model, opt, torch.nn.MSELoss(), args.pop("data"), **args)
    rep = hog.fit(model, opt, torch.nn.MSELoss(), torch.utils.data.TensorDataset(x, y),
                  eval_data=torch.utils.data.TensorDataset(x[:8], y[:8]))  # fmt: skip
    assert rep["workers"][0]["samples"] == 64 and len(rep["evals"]) == 1


def test_a_resume_of_another_model_or_data_names_what_differs_before_any_start(monkeypatch):
    model, data, _ = problem(n=64)  # 9 trainable values
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hog = myelin.Hogbatch(cpu_workers=1, device_batch=(16, 32))
    good = {"weights": flat(model), "epoch": 1, "progress": {"epoch": 1, "cursor": 32, "todo": []},
            "controller": Controller(lo=16, hi=32, ratio=1.0, budget=0.3,
                                     adaptive=True).state_dict()}  # fmt: skip
    hog.check_resume(good, 9, 64)
    ctl = good["controller"]
    bad = [
        ({"weights": torch.zeros(3)}, "Hogbatch.fit\\(resume=...\\): must be a run's report"),
        ({**good, "weights": torch.zeros(3)}, "weights must be the model's 9 .* shape \\(3,\\)"),
        ({**good, "weights": torch.zeros(())}, "shape \\(\\)"),  # copy_ would broadcast it
        ({**good, "controller": {"batch": 32}}, "controller is not the rule's state"),
        ({**good, "controller": {**ctl, "batch": 4096}}, "batch 4096 is outside device_batch"),
        ({**good, "epoch": -1}, "epoch=-1"),
        ({**good, "progress": {"epoch": 1, "cursor": 100, "todo": []}}, "dataset of 64"),
        ({**good, "progress": {"epoch": 1, "cursor": 0, "todo": [[0, 60, 8]]}}, "dataset of 64"),
    ]

    def no_start(self):
        raise AssertionError("a worker started")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", no_start)
    for resume, words in bad:
        with pytest.raises(ConfigError, match=words):
            hog.fit(model, opt, torch.nn.MSELoss(), data, resume=resume)


def test_lock_with_one_worker_is_plain_sgd_bit_for_bit_and_resume_continues(tmp_path):
    model, data, _ = problem()
    model.unused = torch.nn.Parameter(torch.ones(3))  # no gradient: SGD does not decay it
    ref = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    ref.unused = torch.nn.Parameter(torch.zeros(3))
    ref.load_state_dict(model.state_dict())
    recs = []
    state = None
    for part in ("a", "b"):  # one epoch, then a second one resumed from the first's state
        (tmp_path / part).mkdir()
        cfg = myelin.Hogbatch(cpu_workers=0, device_batch=(24, 48), lock=True, budget=0.5,
                              record=str(tmp_path / part), timeout_s=100)  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.01)
        rep = cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=1, resume=state)
        state = rep["state"]
        part_recs = load_records(tmp_path / part)
        assert [r["version"] for r in part_recs] == list(range(len(part_recs)))
        recs += part_recs
    assert state["epoch"] == 2 and state["controller"]["device_seen"] == len(recs)
    # the same batches, in the same order, through torch.optim.SGD
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05, weight_decay=0.01)
    perms = Dispatcher(len(data[0]), 2, cfg.seed)
    seen = {0: 0, 1: 0}
    for r in recs:
        epoch, start, count = r["range"]
        idx = perms.permutation(epoch)[start : start + count]
        sgd.zero_grad()
        torch.nn.MSELoss()(ref(data[0][idx]), data[1][idx]).backward()
        sgd.step()
        seen[epoch] += count
    assert seen == {0: 512, 1: 512}
    assert torch.equal(flat(model), flat(ref))
    assert rep["workers"][0]["share"] == 1.0 and [e["epoch"] for e in rep["evals"]] == [1]


def test_a_run_stopped_after_an_epoch_counts_the_updates_still_in_flight(tmp_path):
    """The workers' batches in flight when `on_epoch` stops the run land in the weights:
    the report counts them, and the state resumes at the first epoch not complete."""
    model, data, _ = problem()
    cfg = myelin.Hogbatch(cpu_workers=1, cpu_batch=4, device_batch=(16, 16), adaptive=False,
                          lock=True, record=str(tmp_path), emulate=((0.01, 0.0), (0.005, 0.0)),
                          timeout_s=100)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rep = cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=20, on_epoch=lambda e, w: e == 0)
    recs = load_records(tmp_path)
    assert sum(w["updates"] for w in rep["workers"]) == len(recs)
    assert sum(w["samples"] for w in rep["workers"]) == sum(r["range"][2] for r in recs)
    done = {e: sum(r["range"][2] for r in recs if r["range"][0] == e) for e in range(20)}
    first_unfinished = min(e for e, n in done.items() if n < len(data[0]))
    assert rep["state"]["epoch"] == first_unfinished >= 1


def test_slow_device_plus_cpu_updates_is_w0_minus_the_sum_of_all_steps(tmp_path):
    """An overwrite (the reference code's model copy-back) would lose the CPU steps."""
    model, data, _ = problem()
    w0 = flat(model).clone()
    cfg = myelin.Hogbatch(cpu_workers=2, cpu_batch=4, device_batch=(128, 128), lock=True,
                          record=str(tmp_path), emulate=((0.4, 0.0), (0.01, 0.0)),
                          timeout_s=100)  # fmt: skip
    rep = cfg.fit(model, torch.optim.SGD(model.parameters(), lr=0.02), torch.nn.MSELoss(), data)
    recs = load_records(tmp_path)
    assert [r["version"] for r in recs] == list(range(len(recs)))
    w = w0.clone()
    for r in recs:
        w.add_(r["step"], alpha=-r["lr"])
    assert torch.equal(flat(model), w)
    dev = [r for r in recs if r["worker"] == 0]
    # CPU steps landed during the device's first batch (its second, already queued, may
    # start after the CPU workers took the rest of the epoch)
    assert dev and dev[0]["version"] - dev[0]["read"] > 0
    assert sum(r["range"][2] for r in recs) == 512  # each sample once
    shares = [x["updates"] for x in rep["workers"]]
    assert sum(shares) == len(recs) and shares[0] == len(dev)
    # the report's staleness is the records' (its queued batches may all come after the CPU
    # workers finished the epoch: only the first is sure to see their steps)
    taus = sorted(r["version"] - r["read"] for r in dev)
    assert rep["workers"][0]["tau_median"] == statistics.median(taus)
    assert all(type(w["tau_median"]) is float for w in rep["workers"])  # not int by parity
    assert rep["workers"][0]["tau_p99"] == taus[-1] > 0


def test_workers_keep_training_their_next_range_while_the_runner_is_busy(tmp_path):
    """Each worker holds its next ranges already (hogbatch_run.AHEAD for the device,
    CPU_AHEAD for a CPU worker): while the runner is held up (here: 2 s in on_epoch), a
    worker trains on instead of waiting for it."""
    model, data, _ = problem()
    cfg = myelin.Hogbatch(cpu_workers=1, cpu_batch=64, device_batch=(64, 64), lock=True,
                          record=str(tmp_path), emulate=((0.2, 0.0), (0.2, 0.0)),
                          timeout_s=100)  # fmt: skip
    held: list[float] = []

    def on_epoch(epoch, wall_s):
        if epoch == 0:
            held.append(time.monotonic())
            time.sleep(2.0)
            held.append(time.monotonic())

    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=2, on_epoch=on_epoch)
    during = [r for r in load_records(tmp_path) if held[0] < r["at"] < held[1]]
    # one range in hand each (the first runner) allowed 2 updates in the 2 s, two each 4;
    # the device's 3 and the CPU worker's 4 (0.8 s of work) allow 7
    assert len(during) >= 6, [(r["worker"], r["at"] - held[0]) for r in during]
    assert sum(r["worker"] == 0 for r in during) >= 2
    assert sum(r["worker"] == 1 for r in during) >= 3


def test_copies_on_the_clock_are_the_shared_weights_of_that_moment(tmp_path):
    """eval_every_s: a copy every 0.1 s, off the training path; each copy's loss is the
    loss of w0 minus the steps made by then (the k counted by the runner, or one more
    that landed before its `done` was read)."""
    model, data, _ = problem()
    w0 = flat(model).clone()
    cfg = myelin.Hogbatch(cpu_workers=0, device_batch=(64, 64), lock=True,
                          record=str(tmp_path), emulate=((0.05, 0.0), (0.0, 0.0)),
                          timeout_s=100)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    rep = cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=2, eval_every_s=0.1)
    recs = load_records(tmp_path)
    assert len(recs) == 16
    losses, w = [], w0.clone()
    probe = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    for r in [None, *recs]:
        if r is not None:
            w.add_(r["step"], alpha=-r["lr"])
        load_flat(list(probe.parameters()), w)
        with torch.no_grad():
            losses.append(float(torch.nn.MSELoss()(probe(data[0]), data[1])))
    timed = rep["evals_timed"]
    assert len(timed) >= 4, timed  # 16 updates of 50 ms: about 8
    walls = [e["wall_s"] for e in timed]
    assert walls == sorted(walls) and all(b - a > 0.05 for a, b in zip(walls, walls[1:]))
    for e in timed:
        k = round(e["epochs"] * 512 / 64)
        assert e["epochs"] * 512 == 64 * k and 0 <= k <= 16
        near = losses[k : k + 2]
        assert min(abs(e["loss"] - v) for v in near) <= 1e-6 * max(near), (e, near)
    # the epochs' own copies are still there, with epochs' worth of samples
    assert [e["epoch"] for e in rep["evals"]] == [0, 1]
    assert [e["epochs"] for e in rep["evals"]][-1] == 2.0


def test_eval_every_s_must_be_positive():
    model, data, _ = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    with pytest.raises(ConfigError, match=r"eval_every_s=0"):
        myelin.Hogbatch().fit(model, opt, torch.nn.MSELoss(), data, eval_every_s=0)


def _kill(name: str, killed: dict) -> None:
    (proc,) = [p for p in multiprocessing.active_children() if p.name == name]
    os.kill(proc.pid, signal.SIGKILL)
    killed["at"] = time.monotonic()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["reassign", "raise"])
def test_lock_free_run_reaches_the_optimum_and_survives_a_dead_cpu_worker(policy):
    model, data, best = problem(n=2048)
    cfg = myelin.Hogbatch(cpu_workers=2, cpu_batch=4, device_batch=(32, 256), adaptive=True,
                          budget=0.5, on_worker_loss=policy, timeout_s=100,
                          emulate=((0.02, 0.0001), (0.002, 0.0005)))  # fmt: skip
    killed: dict = {}

    def on_epoch(epoch, wall_s):  # SIGKILL CPU worker 1 when epoch 2 is complete
        if epoch == 2:
            _kill("hogbatch-cpu1", killed)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if policy == "raise":
        with pytest.raises(PeerLostError, match="worker 1 died") as e:
            cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=40, on_epoch=on_epoch)
        assert e.value.rank == 1 and time.monotonic() - killed["at"] < 10
        return
    rep = cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=40, on_epoch=on_epoch)
    assert "at" in killed
    got = flat(model).double()
    assert torch.isfinite(got).all()
    assert (got - best).norm() / best.norm() < 0.01
    assert rep["workers"][1]["updates"] > 0 and rep["workers"][2]["updates"] > 0
    assert abs(sum(x["share"] for x in rep["workers"]) - 1) < 1e-9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_worker_with_a_cpu_worker_adds_both_kinds_of_steps(tmp_path):
    model, data, _ = problem()
    w0 = flat(model).clone()
    cfg = myelin.Hogbatch(cpu_workers=1, device="cuda", device_batch=(64, 64), lock=True,
                          record=str(tmp_path), timeout_s=100)  # fmt: skip
    rep = cfg.fit(model, torch.optim.SGD(model.parameters(), lr=0.02), torch.nn.MSELoss(), data)
    w = w0.clone()
    for r in load_records(tmp_path):
        w.add_(r["step"], alpha=-r["lr"])
    assert torch.equal(flat(model), w)
    assert all(x["updates"] > 0 for x in rep["workers"])


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_workers_leave_when_their_runner_is_killed():
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "workers" / "hogbatch_parent.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        line = proc.stdout.readline()  # after epoch 0 (the workers start within ~60 s)
        pids = json.loads(line)["pids"]
        assert len(pids) == 3 and all(_running(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _running(p)], "workers outlived their runner by 15 s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.slow
def test_on_epoch_true_stops_the_run_and_resume_starts_at_the_next_epoch():
    model, data, _ = problem()
    cfg = myelin.Hogbatch(cpu_workers=1, device_batch=(32, 32), timeout_s=100,
                          emulate=((0.01, 0.0), (0.005, 0.0)))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    rep = cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=50,
                  on_epoch=lambda epoch, wall_s: epoch == 1)  # fmt: skip
    assert [e["epoch"] for e in rep["evals"]] == [0, 1] and rep["state"]["epoch"] == 2
    assert torch.equal(rep["state"]["weights"], flat(model))


def test_a_loss_the_workers_cannot_receive_is_a_config_error_before_any_start():
    model, data, _ = problem(n=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ConfigError, match="loss_fn .* cannot be sent to the spawned worker"):
        myelin.Hogbatch(cpu_workers=1).fit(model, opt, lambda o, t: (o - t).pow(2).mean(), data)


def test_max_staleness_scales_each_step_by_the_staleness_it_lands_with(tmp_path):
    """The guard reads the staleness where the step lands (under the lock, the version it
    lands at): every step past the bound is scaled by bound / staleness, and the report's
    staleness is the one applied (it was read before waiting for the add)."""
    model, data, _ = problem(n=1024)
    w0 = flat(model).clone()
    cfg = myelin.Hogbatch(cpu_workers=3, cpu_batch=2, device_batch=(8, 8), adaptive=False,
                          lock=True, max_staleness=1, record=str(tmp_path / "new" / "dir"),
                          timeout_s=100)  # fmt: skip  (record: a directory made for it)
    cfg.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.MSELoss(), data)
    recs = load_records(tmp_path / "new" / "dir")
    stale = [r["version"] - r["read"] for r in recs if r["version"] - r["read"] > 1]
    assert stale  # 4 workers under one lock: steps land behind others'
    for r in recs:
        tau = r["version"] - r["read"]
        assert r["lr"] == (0.01 * (1 / tau) if tau > 1 else 0.01)
    w = w0.clone()
    for r in recs:
        w.add_(r["step"], alpha=-r["lr"])
    assert torch.equal(flat(model), w)


def test_a_resume_under_other_settings_uses_them():
    """Fixed Hogbatch resumed from an adaptive run's state trains at its own batch (hi);
    a run with fewer CPU workers forgets the rates of those it does not have."""
    model, data, _ = problem(n=1024)
    emulate = ((0.001, 0.0001), (0.0005, 0.0001))
    first = myelin.Hogbatch(cpu_workers=3, device_batch=(16, 256), budget=0.9, timeout_s=100,
                            emulate=emulate).fit(model, torch.optim.SGD(model.parameters(),
                            lr=0.01), torch.nn.MSELoss(), data)  # fmt: skip
    state = first["state"]
    assert set(state["controller"]["samples"]) == {0, 1, 2, 3}
    assert state["controller"]["batch"] != 256
    fixed = myelin.Hogbatch(cpu_workers=1, device_batch=(16, 256), adaptive=False,
                            timeout_s=100, emulate=emulate)  # fmt: skip
    rep = fixed.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.MSELoss(),
                    data, resume=state)  # fmt: skip
    assert rep["device_batch"] == [(0.0, 256)]
    assert set(rep["state"]["controller"]["samples"]) <= {0, 1}


@pytest.mark.parametrize("policy", ["reassign", "raise"])
def test_a_worker_that_dies_while_the_run_stops_is_lost_as_in_training(policy):
    """on_epoch stops the run and a CPU worker dies then: "raise" names it (it was a raw
    BrokenPipeError), "reassign" returns, the ranges it held left to do."""
    model, data, _ = problem(n=600)
    w0 = flat(model).clone()

    def on_epoch(epoch, wall_s):
        _kill("hogbatch-cpu1", {})
        return True

    cfg = myelin.Hogbatch(cpu_workers=2, cpu_batch=3, device_batch=(16, 32), lock=True,
                          on_worker_loss=policy, timeout_s=30)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if policy == "raise":
        with pytest.raises(PeerLostError, match="worker 1 died"):
            cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=3, on_epoch=on_epoch)
        return
    rep = cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=3, on_epoch=on_epoch)
    assert not torch.equal(flat(model), w0) and torch.equal(rep["state"]["weights"], flat(model))
    progress = rep["state"]["progress"]
    assert rep["state"]["epoch"] >= 1 and progress["samples"] == 600


@pytest.mark.parametrize("policy", ["reassign", "raise"])
def test_a_worker_that_dies_holding_the_lock_as_the_run_stops_frees_it_at_once(policy, monkeypatch):
    """Worker 1 dies holding the shared model's lock while the run stops: the runner frees it
    as soon as that worker is found dead, so worker 0 stops too; it waited on the lock until
    its own timeout and the run failed naming worker 0 (the lock is taken here, for worker
    1, so that it surely holds it)."""
    from myelin.replicas import hogbatch_run

    stores = []
    create = hogbatch_run.SharedModel.create
    monkeypatch.setattr(hogbatch_run.SharedModel, "create",
                        lambda *a, **k: stores.append(create(*a, **k)) or stores[-1])  # fmt: skip
    model, data, _ = problem(n=600)

    def on_epoch(epoch, wall_s):
        (store,) = stores
        assert store.lock.acquire(timeout=10)
        store.owner[0] = 1  # worker 1 holds it...
        _kill("hogbatch-cpu1", {})  # ...and dies
        return True

    cfg = myelin.Hogbatch(cpu_workers=2, cpu_batch=3, device_batch=(16, 32), lock=True,
                          on_worker_loss=policy, timeout_s=20)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.monotonic()
    if policy == "raise":
        with pytest.raises(PeerLostError, match="worker 1 died"):
            cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=3, on_epoch=on_epoch)
    else:
        rep = cfg.fit(model, opt, torch.nn.MSELoss(), data, epochs=3, on_epoch=on_epoch)
        assert torch.equal(rep["state"]["weights"], flat(model))
    assert time.monotonic() - t0 < 15  # not the lock's 20 s timeout


def test_an_epoch_the_batches_in_flight_complete_is_evaluated_and_told():
    """on_epoch stops the run while the next epoch is wholly in flight: that epoch completes
    as the workers stop, and gets its on_epoch call and evaluation like any other."""
    model, data, _ = problem(n=12)
    seen = []
    cfg = myelin.Hogbatch(cpu_workers=1, cpu_batch=2, device_batch=(2, 2), adaptive=False,
                          lock=True, timeout_s=100, emulate=((0.01, 0.0), (0.01, 0.0)))  # fmt: skip
    rep = cfg.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.MSELoss(), data,
                  epochs=3, on_epoch=lambda e, t: seen.append(e) or True)  # fmt: skip
    done = rep["state"]["epoch"]  # the first epoch not complete
    assert done >= 2  # (12 samples in ranges of 2: epoch 1 was all handed out at epoch 0's end)
    assert seen == list(range(done)) and [e["epoch"] for e in rep["evals"]] == seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_a_cuda_device_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match=r"Hogbatch\(device='cuda:7'\): no CUDA device here"):
        myelin.Hogbatch(device="cuda:7")
