"""Stages placed per stage (`stage_devices`), CPU threads per stage, and their errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import myelin
from myelin import ConfigError
from myelin.nn import LazyAdam
from tests._procs import launch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import host_stage  # noqa: E402


def test_two_host_stages_with_their_threads_train_like_one_process(tmp_path):
    job = launch(2, "host_stage.py", [], tmp_path, timeout=180)
    assert job.returncode == 0, job.output[-4000:]
    r0, r1 = job.results[0], job.results[1]
    assert (r0["device"], r1["device"]) == ("cpu", "cpu")
    assert (r0["threads"], r1["threads"]) == (1, 2)  # cpu_threads=[1, 2], per stage
    assert r0["losses"] == r1["losses"] and r1["active"] < 500

    model = host_stage.build()
    body, head = model[:2], model[2]
    opt = LazyAdam(model.parameters(), lr=0.01)
    expected = []
    for s in range(host_stage.STEPS):
        x, y = host_stage.batch(s)
        opt.zero_grad()
        loss = head.loss(body(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert r1["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    model.eval()
    x, y = host_stage.batch(99)
    with torch.no_grad():
        assert r1["eval"] == pytest.approx(head.loss(model(x), y).item(), rel=1e-5)


def test_a_pipeline_built_under_init_empty_materialises_each_stage_as_the_eager_model(tmp_path):
    # each rank allocates only its stage; the LSHSoftmax stage draws its weights, hash
    # functions and tables once allocated (building it on meta raised)
    job = launch(2, "host_stage.py", ["--meta"], tmp_path, timeout=180)
    assert job.returncode == 0, job.output[-4000:]
    model = host_stage.build()
    myelin.init_layers(model, list(model))  # the Linear as the meta path draws it
    opt = LazyAdam(model.parameters(), lr=0.01)
    expected = []
    for s in range(host_stage.STEPS):
        x, y = host_stage.batch(s)
        opt.zero_grad()
        loss = model[2].loss(model[:2](x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert job.results[1]["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def _trainer(**kw):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    return myelin.Trainer(
        model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=torch.nn.MSELoss(), **kw
    )


def test_one_host_stage_sets_its_threads():
    before = torch.get_num_threads()
    try:
        with _trainer(stage_devices=["cpu"], cpu_threads=1) as trainer:
            assert trainer.world.device.type == "cpu"
            assert torch.get_num_threads() == 1
            trainer.step(torch.randn(2, 4), torch.randn(2, 4))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"stage_devices": ["cpu", "cpu"]}, "stage_devices"),
        ({"stage_devices": "cpu"}, "stage_devices"),
        ({"stage_devices": ["tpu"]}, r"stage_devices\[0\]"),
        ({"stage_devices": ["meta"]}, r"stage_devices\[0\]"),
        ({"stage_devices": ["cpu"], "device": "cpu"}, "not both"),
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"cpu_threads": [1, 2]}, "cpu_threads"),
        ({"cpu_threads": [0]}, r"cpu_threads\[0\]"),
    ],
)
def test_bad_placements_are_rejected_naming_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        _trainer(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a CPU-only machine")
def test_a_gpu_stage_on_a_machine_without_one_is_rejected_naming_the_stage():
    with pytest.raises(ConfigError, match=r"stage_devices\[0\]='cuda': no CUDA here"):
        _trainer(stage_devices=["cuda"])
