"""Ranks that part ways end the job within seconds, with an error naming the other rank.

A rank that dies, or leaves with an error, while its peer is somewhere other than a
training step (inside close(), a profile gather, a checkpoint save, a barrier, or its own
code between steps): the peer raises within 5 s, naming the lost rank (issue 11). A rank
that closes its trainer while the other still expects it (uneven steps, uneven
evaluations, uneven loaders under data parallelism): the waiting rank raises within 5 s,
naming the peer and the steps each reached (issue 20). A rank whose Trainer(resume=) fails
is named with its error, not as one that left early. Workers: tests/workers/parting.py.

The bound asserted is the issue's 5 s for the error (the rank's own clock against the
victim's), and 15 s for the whole job to end: after the error, each process still tears
down an interpreter with torch loaded, which took up to 9 s on this project's 2-core
machine at a load average of 20. Before the fix these took 30 s (the launcher's grace
period) or 30-300 s (a deadline).
"""

from __future__ import annotations

import json
import time

import pytest

from tests._procs import launch

RAISE_S = 5.0  # the bound: the error comes within 5 s
END_S = 15.0  # and the job has ended, every process reaped (interpreter teardown, loaded)


def run(tmp_path, mode, die=None, nproc=2, extra=()):
    args = [mode] + ([f"--die={die}"] if die else []) + list(extra)
    job = launch(nproc, "parting.py", args, tmp_path, timeout=90)
    ended = time.time()
    victim = json.loads((tmp_path / "out" / "victim.json").read_text())
    return job, victim, ended


def check_place(job, victim, ended, *, lost_phrase):
    assert job.returncode != 0, job.output[-3000:]
    res = job.results.get(0)
    assert res is not None, f"rank 0 wrote nothing:\n{job.output[-4000:]}"
    assert not res.get("finished_place"), res  # the place itself raised
    assert res["error_type"] in ("PeerLostError", "PeerLeftError"), res
    assert res["lost"] == 1 and "rank 1 (stage 1, replica 0)" in res["error"], res
    assert lost_phrase in res["error"], res
    assert res["time"] - victim["time"] < RAISE_S, res["time"] - victim["time"]
    assert ended - victim["time"] < END_S, ended - victim["time"]


@pytest.mark.parametrize(
    ("mode", "die"),
    [
        ("close", "raise"),  # the case: the survivor ignored the launcher for 30 s
        pytest.param(
            "barrier",
            "raise",
            marks=[
                pytest.mark.slow,
                pytest.mark.xfail(  # a known limit: 6 s that assert nothing
                    reason="a user's own dist.barrier() fails with gloo's RuntimeError as soon as "
                    "the peer's connection closes, before the heartbeats name the peer; myelin "
                    "does not wrap collectives it did not issue (its own go through "
                    "runtime/bounded.py)",
                    strict=False,
                ),
            ],
        ),
        pytest.param("user", "raise", marks=pytest.mark.slow),
        pytest.param("gather", "raise", marks=pytest.mark.slow),
        pytest.param("checkpoint", "kill", marks=pytest.mark.slow),
        ("state_dict", "kill"),  # its gather was plain send/recv: gloo's error, unnamed
    ],
)
def test_a_rank_that_dies_is_named_wherever_its_peer_is(tmp_path, mode, die):
    job, victim, ended = run(tmp_path, mode, die)
    phrase = "its process" if die == "kill" else "the victim's own code failed"
    check_place(job, victim, ended, lost_phrase=phrase)
    if mode in ("close", "user"):  # the launcher names the rank that raised, not its peer
        assert "myelin run: rank 1 failed first" in job.output, job.output[-3000:]


def test_a_peer_frozen_during_state_dict_is_named_without_a_launcher(tmp_path):
    """Ranks started by hand (as on two hosts: no launcher stops the survivor). state_dict's
    gather was plain send/recv: a frozen peer left rank 0 in C++ until the heartbeats'
    escalation killed it with no error of its own; its waits are now bounded and polled."""
    import os
    import socket
    import subprocess
    import sys

    from tests._procs import WORKERS

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    base = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    base.update(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(WORKERS / "parting.py"), "--out", str(out), "state_dict"]
    procs = [
        subprocess.Popen(
            [*cmd, "--die=stop"],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        _, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert (out / "rank0.json").exists(), err[-3000:]
    res = json.loads((out / "rank0.json").read_text())
    victim = json.loads((out / "victim.json").read_text())
    assert res["error_type"] == "PeerLostError" and res["lost"] == 1, res
    assert "nothing came from it" in res["error"], res
    # frozen, not gone: the heartbeats' 5 s silence, then at most a slice and a look
    assert res["time"] - victim["time"] < 2 * RAISE_S, res["time"] - victim["time"]


def test_a_rank_whose_with_block_raises_is_named_with_its_error(tmp_path):
    """The victim raises inside `with Trainer(...)` (profile on) while rank 0 is in a step:
    before, it closed as if cleanly (a 60 s profile gather, then rank 0 blamed uneven steps)."""
    job, victim, ended = run(tmp_path, "with", "raise")
    res = job.results.get(0)
    assert res is not None, f"rank 0 wrote nothing:\n{job.output[-4000:]}"
    assert not res.get("finished_place"), res
    assert res["error_type"] in ("RemoteError", "PeerLostError"), res
    assert "rank 1" in res["error"] and "inside its with block" in res["error"], res
    assert res["time"] - victim["time"] < RAISE_S, res["time"] - victim["time"]
    assert ended - victim["time"] < END_S, ended - victim["time"]
    assert "myelin run: rank 1 failed first" in job.output, job.output[-3000:]


def exit_codes(job) -> str:
    """The launcher's 'exit codes by rank: {...}'."""
    line = next(x for x in job.output.splitlines() if x.startswith("myelin run: rank"))
    return line.split("exit codes by rank: ")[1].split("}")[0] + "}"


def check_survivors_ended_well(job, tmp_path, survivors):
    """Each survivor lived through a SIGTERM at exit (its own error ends it: not -15, and
    no handler raised in an exit handler), and the launcher names the killed rank."""
    victim = max(survivors) + 1
    first = f"myelin run: rank {victim} failed first (exit code -9)"
    assert first in job.output, job.output[-3000:]
    assert "Exception ignored in atexit" not in job.output, job.output[-3000:]
    assert "-15" not in exit_codes(job), exit_codes(job)
    for r in survivors:
        assert (tmp_path / "out" / f"exit{r}.json").exists(), (r, job.output[-3000:])


def test_a_rank_killed_in_a_save_of_three_is_named_by_both_survivors(tmp_path):
    """Three ranks, the last SIGKILLed while the others are in trainer.save, their errors
    ending their scripts. The save's PeerLostError is now the trainer's failure (its
    flight record written, its peers told the lost rank), not an error "in the script,
    outside the trainer": before, a survivor told the launcher it had failed (and was
    named as failing first, exit code -15), and its goodbye made the other survivor
    blame it rather than rank 2."""
    job, victim, ended = run(tmp_path, "checkpoint", "kill", 3, ["--end-with-error"])
    for r in (0, 1):  # (a survivor may see the loss before its own save begins)
        res = job.results.get(r)
        assert res is not None, f"rank {r} wrote nothing:\n{job.output[-4000:]}"
        assert res["error_type"] == "PeerLostError" and res["lost"] == 2, res
        assert res["time"] - victim["time"] < RAISE_S, res["time"] - victim["time"]
        # where the victim was (its own code), not the last op it ran
        assert "it was last between steps, after 3 training steps" in res["error"], res
    check_survivors_ended_well(job, tmp_path, (0, 1))
    assert ended - victim["time"] < END_S, ended - victim["time"]


@pytest.mark.slow
def test_a_rank_killed_in_a_user_barrier_is_the_one_that_failed_first(tmp_path):
    """Rank 1 SIGKILLed while rank 0 waits in its own dist.barrier(): gloo's error ends
    rank 0's script after the heartbeats saw the loss, so rank 0 does not tell the
    launcher it failed (it was named as failing first), and the launcher's SIGTERM at its
    exit no longer raises inside its exit handlers."""
    job, victim, ended = run(tmp_path, "barrier", "kill", 2, ["--end-with-error"])
    res = job.results.get(0)
    assert res is not None and res["error_type"] is not None, job.output[-4000:]
    check_survivors_ended_well(job, tmp_path, (0,))
    assert ended - victim["time"] < END_S, ended - victim["time"]


def check_uneven(job, victim, ended, *, mine: str, peer: str):
    res = job.results.get(0)
    assert res is not None, f"rank 0 wrote nothing:\n{job.output[-4000:]}"
    assert res["error_type"] == "PeerLeftError", res
    error = res["error"]
    assert res["lost"] == 1, res
    assert f"rank 1 (stage {peer}" in error, error
    assert mine in error, error
    assert "every rank must run the same steps and evaluations" in error, error
    assert res["time"] - victim["time"] < RAISE_S, res["time"] - victim["time"]
    assert ended - victim["time"] < END_S, ended - victim["time"]
    assert job.results[1]["error_type"] is None, job.results[1]  # the rank that left is fine


def test_uneven_step_counts_end_the_job_naming_the_steps(tmp_path):
    job, victim, ended = run(tmp_path, "uneven-steps")
    check_uneven(
        job,
        victim,
        ended,
        mine="rank 0 (stage 0, replica 0) is in training step 3",
        peer="1, replica 0) closed its trainer after 2 trainer.step and 0 eval_step calls",
    )


def test_a_rank_that_evaluates_where_its_peer_trains_is_told_at_once(tmp_path):
    """eval_step on rank 0 where rank 1 calls step: rank 1 refuses the evaluation's
    activations (before a training forward runs on them) and both fail within the bound."""
    job, victim, ended = run(tmp_path, "mixed-steps")
    assert job.returncode != 0, job.output[-3000:]
    mine, peer = job.results[1], job.results[0]
    words = "rank 0 evaluates step 1 while rank 1 trains it: every rank must call step()"
    assert mine["error_type"] == "MyelinError" and words in mine["error"], mine
    assert peer["error_type"] == "RemoteError" and words in peer["error"], peer
    assert mine["unchanged"] and peer["unchanged"]  # nothing trained on the eval batch
    assert mine["time"] - victim["time"] < RAISE_S and peer["time"] - victim["time"] < RAISE_S


def test_a_save_on_one_rank_while_its_peer_steps_ends_both_naming_the_calls(tmp_path):
    """The DDP habit, `if rank == 0: trainer.save(...)`: rank 0 waited in the save and
    rank 1 in its next step for the whole timeout (30 s here, 300 by default), neither
    error naming the other call. Their heartbeats say which call each is in."""
    job, victim, ended = run(tmp_path, "save-on-one")
    assert job.returncode != 0, job.output[-3000:]
    errors = [job.results[r] for r in (0, 1)]  # either may find it first; the other is told
    assert any(e["error_type"] == "MyelinError" for e in errors), errors
    for e in errors:
        for words in ("in a checkpoint save", "in training step 2", "both after 1 trainer.step"):
            assert words in e["error"], (words, e)
    assert all(e["time"] - victim["time"] < RAISE_S + 2 for e in errors), errors


@pytest.mark.slow
def test_uneven_evaluations_end_the_job_naming_the_steps(tmp_path):
    job, victim, ended = run(tmp_path, "uneven-eval")
    check_uneven(
        job,
        victim,
        ended,
        mine="rank 0 (stage 0, replica 0) is in evaluation step 2",
        peer="1, replica 0) closed its trainer after 2 trainer.step and 1 eval_step calls",
    )


def test_uneven_loaders_under_data_parallelism(tmp_path):
    job, victim, ended = run(tmp_path, "uneven-fit")
    r0, r1 = job.results[0], job.results[1]
    # uneven="shortest" (the default): both replicas stop after the shorter loader's 3 steps
    assert r0["shortest"]["steps"] == r1["shortest"]["steps"] == [1, 2, 3], (r0, r1)
    assert r0["shortest"]["losses"] == r1["shortest"]["losses"]  # averaged over replicas
    assert r0["shortest"]["tokens_per_s"] == r1["shortest"]["tokens_per_s"]  # 16 + 12 rows
    # uneven="raise": every rank raises before its first step, naming each rank's length
    for res in (r0, r1):
        raised = res["raise"]
        assert raised["error_type"] == "ConfigError", raised
        assert raised["steps_done"] == 3, raised  # no step was run
        assert "rank 0: 5 batches" in raised["error"] and "rank 1: 3 batches" in raised["error"]
    # loaders without len(): the longer replica learns, within seconds, that the other left
    assert victim["steps"] == 6 and victim["before"] == 3
    check_uneven(
        job,
        victim,
        ended,
        mine="rank 0 (stage 0, replica 0) is in training step 7",
        peer="0, replica 1) closed its trainer after 6 trainer.step and 0 eval_step calls",
    )


def test_a_rank_whose_resume_fails_is_named_by_its_peer(tmp_path):
    """Rank 1's own shard is truncated: its Trainer(resume=) raises CheckpointError, and
    rank 0, already resumed and stepping, is told why within seconds: not that rank 1
    left early, as a rank that closes its trainer after fewer steps would have."""
    job, victim, ended = run(tmp_path, "bad-resume")
    r0, r1 = job.results.get(0), job.results.get(1)
    assert r1 is not None and r1["error_type"] == "CheckpointError", job.output[-3000:]
    assert "corrupt or truncated" in r1["error"], r1
    assert r0 is not None, f"rank 0 wrote nothing:\n{job.output[-4000:]}"
    assert r0.get("resumed_at") == 2 and "steps" not in r0, r0
    assert r0["error_type"] == "RemoteError" and r0["lost"] == 1, r0
    assert "rank 1 failed: CheckpointError" in r0["error"], r0
    assert "corrupt or truncated" in r0["error"], r0
    assert "every rank must run the same steps" not in r0["error"], r0
    assert r0["time"] - victim["time"] < RAISE_S, r0["time"] - victim["time"]
    assert ended - victim["time"] < END_S, ended - victim["time"]
