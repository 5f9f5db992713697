"""A rank that fails or goes silent is reported, by name, on the others: never a hang."""

from __future__ import annotations

import pytest

from tests._procs import launch


def test_silent_peer_raises_deadline_naming_what_never_came(tmp_path):
    job = launch(2, "failures.py", ["deadline"], tmp_path, timeout=90)
    assert job.returncode != 0
    err = job.results[0]
    assert err["error_type"] == "DeadlineError", err
    for part in (
        "rank 0 (stage 0, replica 0)",
        "training step 1",  # the trainer's count, from 1
        "gradient of microbatch 0",
        "from rank 1",
        "0B0",
    ):
        assert part in err["error"], (part, err["error"])
    assert err["elapsed"] < 15


def test_failing_rank_aborts_its_peers_quickly(tmp_path):
    job = launch(2, "failures.py", ["remote"], tmp_path, timeout=90)
    assert job.returncode != 0
    assert job.results[1]["error_type"] == "ValueError"
    peer = job.results[0]
    assert peer["error_type"] == "RemoteError", peer
    assert "rank 1 failed" in peer["error"] and "boom in the loss" in peer["error"]
    assert peer["elapsed"] < 15  # told at once, not after the 60 s timeout


@pytest.mark.slow  # 8 s; the same ConfigError in one process: test_trainer.py
def test_batch_that_does_not_split_fails_on_every_rank_before_work(tmp_path):
    job = launch(2, "failures.py", ["badbatch"], tmp_path, timeout=90)
    for rank in (0, 1):
        err = job.results[rank]
        assert err["error_type"] == "ConfigError", err
        assert "batch of 3 rows cannot be split into microbatches=4" in err["error"]


@pytest.mark.slow  # 5 s; the same check in one process: test_config_errors.py
def test_world_size_that_is_not_stages_times_replicas(tmp_path):
    job = launch(2, "failures.py", ["worldsize"], tmp_path, timeout=90)
    for rank in (0, 1):
        err = job.results[rank]
        assert err["error_type"] == "ConfigError", err
        assert "needs a world of 3 processes" in err["error"] and "says 2" in err["error"]
