"""Checkpoints: resume gives the same next losses; damage and mismatches are named."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from myelin import ConfigError, Trainer
from myelin.checkpoint import CheckpointError, latest_version, verify

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def model(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Dropout(0.2), nn.Tanh(), nn.Linear(width, 4))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(trainer, steps):
    return [trainer.step(*batch(trainer.steps_done)) for _ in range(steps)]


def test_resume_continues_with_the_same_losses(tmp_path):
    with Trainer(model(), ADAMW, F.cross_entropy, microbatches=2) as trainer:
        train(trainer, 3)
        trainer.save(tmp_path / "ckpt", extra={"epoch": 1, "position": 24})
        expected = train(trainer, 3)  # dropout draws from the RNG, which is restored too
    with Trainer(
        model(), ADAMW, F.cross_entropy, microbatches=2, resume=tmp_path / "ckpt"
    ) as again:
        assert again.steps_done == 3 and again.resumed_extra == {"epoch": 1, "position": 24}
        assert train(again, 3) == expected


def test_shards_load_with_weights_only_and_old_versions_are_pruned(tmp_path):
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        for _ in range(3):
            train(trainer, 1)
            trainer.save(tmp_path)
    versions = sorted(p.name for p in tmp_path.glob("step-*"))
    assert versions == ["step-00000002", "step-00000003"]
    shard = torch.load(latest_version(tmp_path) / "rank0.pt", weights_only=True)
    assert shard["steps_done"] == 3 and "0.weight" in shard["model"]


def test_a_save_killed_before_its_manifest_leaves_the_previous_one(tmp_path):
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        train(trainer, 1)
        trainer.save(tmp_path)
        train(trainer, 1)
        trainer.save(tmp_path)
    # simulate a kill after the shard of step 2 but before its manifest and pointer
    (tmp_path / "step-00000002" / "manifest.json").unlink()
    (tmp_path / "latest").write_text("step-00000001")
    with Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path) as again:
        assert again.steps_done == 1


def test_corrupt_shard_is_named(tmp_path):
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        train(trainer, 1)
        trainer.save(tmp_path)
    shard = latest_version(tmp_path) / "rank0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank0.pt is corrupt or truncated"):
        Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path)


def test_truncated_shard_is_named(tmp_path):
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        train(trainer, 1)
        trainer.save(tmp_path)
    shard = latest_version(tmp_path) / "rank0.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"rank0.pt is corrupt or truncated"):
        verify(tmp_path)


def test_a_file_that_is_no_myelin_shard_or_manifest_is_named(tmp_path):
    """Its checksum matches the manifest (written by hand): its content is checked too."""
    import hashlib
    import io
    import json
    import pickle

    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        train(trainer, 1)
        trainer.save(tmp_path)
    vdir = latest_version(tmp_path)
    manifest = json.loads((vdir / "manifest.json").read_text())

    def put(payload):
        (vdir / "rank0.pt").write_bytes(payload)
        manifest["shards"]["0"]["sha256"] = hashlib.sha256(payload).hexdigest()
        (vdir / "manifest.json").write_text(json.dumps(manifest))

    other = io.BytesIO()
    torch.save({"format": 2, "weights": torch.zeros(1)}, other)
    put(other.getvalue())
    with pytest.raises(
        CheckpointError, match=r"rank0.pt is not a myelin shard: it has no \['steps"
    ):
        Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path)
    put(pickle.dumps(print))  # a callable: refused by weights_only, never run
    with pytest.raises(CheckpointError, match=r"rank0.pt is not a myelin shard torch can read"):
        Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path)
    del manifest["stages"]
    (vdir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"manifest.json is not a myelin manifest: .*stages"):
        Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path)


def test_mismatched_model_says_what_differs(tmp_path):
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        trainer.save(tmp_path)
    with pytest.raises(CheckpointError) as info:
        Trainer(model(width=32), ADAMW, F.cross_entropy, resume=tmp_path)
    assert "0.weight: checkpoint has shape (16, 8), model has (32, 8)" in str(info.value)


def test_another_optimizer_class_is_named_before_anything_loads(tmp_path):
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        train(trainer, 2)
        trainer.save(tmp_path)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(
        CheckpointError,
        match="optimizer is torch.optim.adamw.AdamW, this trainer's is torch.optim.sgd.SGD",
    ):
        Trainer(model(), sgd, F.cross_entropy, resume=tmp_path)
    adam = functools.partial(torch.optim.Adam, lr=1e-2)  # would have become AdamW silently
    with pytest.raises(CheckpointError, match="torch.optim.adam.Adam"):
        Trainer(model(), adam, F.cross_entropy, resume=tmp_path)


def test_saving_again_at_the_same_step_never_writes_into_the_live_version(tmp_path):
    """A second save at step 2 (after fit's last one, or at each start) goes to step-2.1:
    until its manifest and `latest` are down, step-2 stays whole and loadable."""
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        train(trainer, 2)
        first = trainer.save(tmp_path)
        before = {f.name: f.read_bytes() for f in first.iterdir()}
        second = trainer.save(tmp_path, extra={"again": True})
        assert {f.name: f.read_bytes() for f in first.iterdir()} == before  # untouched
        third = trainer.save(tmp_path)
    assert (first.name, second.name, third.name) == (
        "step-00000002",
        "step-00000002.1",
        "step-00000002.2",
    )
    assert not first.exists()  # pruned after the third: two versions kept
    assert latest_version(tmp_path) == third and verify(tmp_path) == third
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [second.name, third.name]
    with Trainer(model(), ADAMW, F.cross_entropy, resume=second) as again:
        assert again.resumed_extra == {"again": True} and again.steps_done == 2


def test_a_run_resumed_from_an_older_version_keeps_its_own_past(tmp_path):
    """Run A saved steps 2 and 4; run B resumed from step 2 and saves step 3: A's step 4
    (a future B abandoned) goes, B's fallback (step 2) stays."""
    with Trainer(model(), ADAMW, F.cross_entropy) as a:
        train(a, 2)
        a.save(tmp_path)
        train(a, 2)
        a.save(tmp_path)
    with Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path / "step-00000002") as b:
        train(b, 1)
        b.save(tmp_path)
        assert sorted(p.name for p in tmp_path.glob("step-*")) == [
            "step-00000002",
            "step-00000003",
        ]
        train(b, 1)
        assert b.save(tmp_path).name == "step-00000004"  # a new version, not A's rewritten
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="resume=.* no complete checkpoint"):
        Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path / "nothing")


def test_two_stage_pipeline_resumes_with_the_same_losses(tmp_path):
    from tests._procs import launch

    job = launch(2, "checkpointing.py", [str(tmp_path / "ckpt")], tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    for rank in (0, 1):
        assert job.results[rank]["resumed"] == job.results[rank]["expected"]
    assert sorted(p.name for p in latest_version(tmp_path / "ckpt").iterdir()) == [
        "manifest.json",
        "rank0.pt",
        "rank1.pt",
    ]


def _kill_one_rank_mid_save(tmp_path, delay):
    """Start a 2-rank job that saves after every step, SIGKILL rank 1 `delay` s into saving."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests._procs import WORKERS, _reap_session

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "MYELIN_RUN_DIR": str(tmp_path)}  # the survivor's flight record: not in the cwd
    cmd = [
        sys.executable,
        "-m",
        "myelin.cli",
        "run",
        "-n",
        "2",
        str(WORKERS / "save_forever.py"),
        "--out",
        str(out),
        str(ckpt),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )
    try:
        start = time.monotonic()
        while not (ckpt / "latest").exists() or not (out / "pid1").exists():
            assert time.monotonic() - start < 90, "no checkpoint appeared"
            assert proc.poll() is None, "the job ended before saving"
            time.sleep(0.02)
        time.sleep(delay)
        os.kill(int((out / "pid1").read_text()), signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _reap_session(proc.pid)
    vdir = verify(ckpt)
    for shard in vdir.glob("rank*.pt"):  # complete, and loadable without pickle
        assert "model" in torch.load(shard, weights_only=True)
    return vdir


def test_a_rank_killed_while_saving_leaves_a_complete_checkpoint(tmp_path):
    vdir = _kill_one_rank_mid_save(tmp_path, delay=0.3)
    assert sorted(p.name for p in vdir.iterdir()) == ["manifest.json", "rank0.pt", "rank1.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(24))
def test_many_kills_at_random_points_of_saving(tmp_path, attempt):
    import random

    _kill_one_rank_mid_save(tmp_path, delay=random.Random(attempt).uniform(0.0, 1.5))


def test_a_whole_model_stream_resumed_by_layers_is_named_as_such():
    """A checkpoint of a one-stage run that drew from one stream ("model", as a model with
    pipeline_layers() did before it drew per layer) resumed by layers: the warning says
    what the checkpoint holds, not that it holds no stream."""
    from myelin.reshard import _unmoved_streams

    text = _unmoved_streams(["0", "1"], 0, False, "ckpt (rank 0)", whole=True)
    assert "the one random stream of a model that ran its own forward" in text
    assert "holds no stream" not in text
    assert "holds no stream for layer(s) 0, 1" in _unmoved_streams(["0", "1"], 0, False, "x")


def test_extra_a_resume_could_not_read_is_refused_at_the_save_naming_it(tmp_path):
    """A Path (or a numpy scalar, a datetime) in `extra` made the whole shard unreadable
    by the resume's weights-only load: weights and optimizer lost."""
    import datetime
    import pathlib

    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        train(trainer, 1)
        for extra, where in (
            ({"out": pathlib.Path("/tmp/x")}, r"extra\['out'\] is a pathlib\.PosixPath"),
            ({"log": [1, {"at": datetime.datetime(2026, 1, 1)}]},
             r"extra\['log'\]\[1\]\['at'\] is a datetime\.datetime"),  # fmt: skip
            ({"r": range(3)}, r"extra\['r'\] is a range"),
        ):
            with pytest.raises(ConfigError, match=where):
                trainer.save(tmp_path / "ckpt", extra=extra)
        assert not (tmp_path / "ckpt").exists()  # nothing written
        kept = {"epoch": 2, "seen": {3, 4}, "t": torch.ones(2), "name": ("a", b"b", None)}
        trainer.save(tmp_path / "ckpt", extra=kept)
    with Trainer(model(), ADAMW, F.cross_entropy, resume=tmp_path / "ckpt") as again:
        got = again.resumed_extra
    assert got["epoch"] == 2 and got["seen"] == {3, 4} and torch.equal(got["t"], torch.ones(2))
    assert got["name"] == ("a", b"b", None)


def test_a_run_resumed_from_an_older_version_keeps_it_and_drops_the_abandoned_one(tmp_path):
    """Saves at steps 2 and 4; resumed from step 2 and saved at step 4 again (step-4.1):
    step 2, its own fallback, stays and the abandoned step-4 goes (it was the reverse)."""
    ckpt = tmp_path / "ckpt"
    with Trainer(model(), ADAMW, F.cross_entropy) as trainer:
        for _ in range(2):
            train(trainer, 2)
            trainer.save(ckpt)
    resumed = Trainer(model(), ADAMW, F.cross_entropy, resume=ckpt / "step-00000002")
    with resumed:
        train(resumed, 2)
        saved = resumed.save(ckpt)
        assert saved.name == "step-00000004.1"
        assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000004.1"]
        train(resumed, 2)  # its line goes on: the version before the new one is its own
        resumed.save(ckpt)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000004.1", "step-00000006"]
