"""Pipelines of real processes train exactly like one process with gradient accumulation."""

from __future__ import annotations

import pytest

from tests._procs import launch

TOL = 1e-5
HALF = ("bf16", "fp16")  # trained only against each other: the reference is fp32


def _check(job, cases, nproc):
    assert job.returncode == 0, job.output[-5000:]
    assert sorted(job.results) == list(range(nproc)), job.output[-3000:]
    for case in cases:
        for rank, res in job.results.items():
            got = res[case]
            assert got["param_diff"] <= TOL, (case, rank, got["param_diff"])
            for step, (a, b) in enumerate(zip(got["losses"], got["ref_losses"], strict=True)):
                assert abs(a - b) <= TOL, (case, rank, step, a, b)
            if rank == 0:
                assert got["state_dict_diff"] <= TOL, (case, got["state_dict_diff"])
            kind = case.split(":")[4]
            assert got["transport"] == kind


def _same_params(job, cases):
    """Whether every rank ends with bit-identical parameters under each of `cases`."""
    for res in job.results.values():
        digests = {res[c]["digest"] for c in cases}
        assert len(digests) == 1, (cases, digests)


TWO = [
    "mlp:2:1:message-driven:ipc:fixed",
    "mlp:2:1:message-driven:tcp:fixed",
    "multi:2:1:message-driven:ipc:fixed",
    "gpt:2:1:message-driven:tcp:fixed",
    "gpt:2:1:gpipe:ipc:fixed",
    "gpt:2:1:1f1b:ipc:fixed",
    "gpt:2:1:message-driven:ipc:fixed",
    "gpt:2:1:message-driven:ipc:varied",
    "gpt:2:1:1f1b:tcp:varied",
    "gpt:2:1:zero-bubble:ipc:fixed",
    "gpt:2:1:zero-bubble:tcp:varied",
]

FOUR = [
    "mlp:4:1:message-driven:tcp:fixed",
    "multi:4:1:1f1b:tcp:fixed",
    "gpt:4:1:gpipe:ipc:fixed",
    "gpt:4:1:1f1b:ipc:fixed",
    "gpt:4:1:message-driven:ipc:fixed",
    "gpt:4:1:message-driven:tcp:varied",
    "mlp:2:2:message-driven:ipc:fixed",
    "gpt:2:2:1f1b:tcp:varied",
    "gpt:4:1:zero-bubble:ipc:fixed",
    "gpt:2:2:zero-bubble:tcp:varied",
]


def _split(job, case, stages=None):
    """Whether every rank (of `stages`) of `case` ran W operations: its backwards split."""
    for res in job.results.values():
        if stages is None or res[case]["stage"] in stages:
            assert res[case]["weights"] > 0, (case, res[case]["stage"])


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """One 2-rank job for every two-stage case, plain and offloaded (each launch costs
    its processes' torch imports)."""
    tmp = tmp_path_factory.mktemp("two")
    return launch(2, "equivalence.py", TWO + META_AND_TIED + OFFLOADED_TWO, tmp, timeout=360)


def test_two_stages_match_single_process(two):
    job = two
    _check(job, TWO, 2)
    _same_params(job, TWO[4:7] + TWO[9:10])  # the four schedules agree bit for bit
    varied = ["gpt:2:1:message-driven:ipc:varied", "gpt:2:1:1f1b:tcp:varied"]
    _same_params(job, varied + TWO[10:])
    for case in TWO[9:]:
        _split(job, case)


def test_four_processes_match_single_process(tmp_path):
    job = launch(4, "equivalence.py", FOUR, tmp_path, timeout=240)
    _check(job, FOUR, 4)
    _same_params(job, FOUR[2:5] + FOUR[8:9])
    _same_params(job, ["gpt:2:2:1f1b:tcp:varied", "gpt:2:2:zero-bubble:tcp:varied"])
    for case in FOUR[8:]:
        _split(job, case)
    for res in job.results.values():  # stage 0's last backward, whole, overlaps the all-reduce
        if res["gpt:2:2:zero-bubble:tcp:varied"]["stage"] == 0:
            assert res["gpt:2:2:zero-bubble:tcp:varied"]["overlapped"] == 5  # every step
    for case in ("mlp:2:2:message-driven:ipc:fixed", "gpt:2:2:1f1b:tcp:varied"):
        by_stage = {}
        for res in job.results.values():
            by_stage.setdefault(res[case]["stage"], set()).add(res[case]["digest"])
        assert all(len(d) == 1 for d in by_stage.values()), "replicas drifted apart"


@pytest.mark.slow  # 9 s; test_train and test_peer_loss run under torchrun too
def test_runs_unchanged_under_torchrun(tmp_path):
    cases = ["gpt:2:1:message-driven:ipc:varied"]
    job = launch(2, "equivalence.py", cases, tmp_path, launcher="torchrun")
    _check(job, cases, 2)


# HF GPT-2 (its embedding tied to the head on the other stage) and meta-device init
META_AND_TIED = [
    "hf:2:1:message-driven:ipc:fixed",
    "hf:2:1:1f1b:tcp:varied:meta",
    "gpt:2:1:gpipe:ipc:fixed:meta",
]


def test_hf_gpt2_with_tied_embedding_and_meta_init_matches_single_process(two):
    _check(two, META_AND_TIED, 2)


def _offload_cases(base, names=("none", "act", "opt", "stream", "both"), precision=None):
    more = f":{precision}" if precision else ""
    return [f"{base}:eager:{name}{more}" for name in names]


def _identical(job, cases):
    """Bit-identical parameters and exactly equal losses on every rank under `cases`."""
    _same_params(job, cases)
    for res in job.results.values():
        assert len({tuple(res[c]["losses"]) for c in cases}) == 1, cases


def _paged(job, case, activations=True, optimizer=True):
    """Whether every rank really paged activations out (the last stage too: within each
    microbatch, as its backward follows the forward at once) and held optimizer state on
    the host."""
    mem = [res[case]["memory"] for res in job.results.values()]
    assert not activations or all(m["activations_offloaded_total_bytes"] > 0 for m in mem)
    assert not optimizer or all(m["optimizer_host_bytes"] > 0 for m in mem)


# The offloaded two-stage cases, by what is checked of them
GPIPE = _offload_cases("gpt:2:1:gpipe:ipc:fixed")
VARIED = _offload_cases("gpt:2:1:message-driven:ipc:varied")
TIED = ["hf:2:1:1f1b:ipc:fixed:eager:none", "hf:2:1:1f1b:ipc:fixed:eager:both"]
EXACT = [f"{case}:fp32:microbatch" for case in TIED]  # GPT-2's tie added per microbatch
# GPT-2's blocks are Conv1D (addmm), not F.linear: under zero-bubble nothing splits there
EXACT_SPLIT = [*EXACT, "hf:2:1:zero-bubble:ipc:fixed:eager:none:fp32:microbatch"]
HALVES = [_offload_cases("gpt:2:1:1f1b:ipc:fixed", ("none", "both"), p) for p in HALF]
# split backwards, their W streaming gradients to the host; under bf16; and with pages
# out (where backwards run whole: W would find the pages gone)
SPLIT = _offload_cases("gpt:2:1:zero-bubble:ipc:varied", ("stream", "both"))
BF16 = _offload_cases("gpt:2:1:zero-bubble:ipc:fixed", ("none", "stream"), "bf16")
CHECKED = GPIPE + VARIED + TIED + EXACT_SPLIT + SPLIT
OFFLOADED_TWO = CHECKED + sum(HALVES, BF16)


def test_offload_changes_nothing_on_two_stages(two):
    job = two
    _check(job, CHECKED, 2)
    for group in (GPIPE, VARIED + SPLIT, TIED, EXACT_SPLIT, HALVES[0] + BF16, HALVES[1]):
        _identical(job, group)
    for group in (GPIPE, VARIED, TIED, EXACT, *HALVES):
        _paged(job, group[-1])
    for res in job.results.values():  # one process's bits, offloaded or not
        assert all(res[c]["param_diff"] == 0.0 for c in EXACT_SPLIT), EXACT_SPLIT
        assert all(res[c]["losses"] == res[c]["ref_losses"] for c in EXACT_SPLIT), EXACT_SPLIT
    for case in (SPLIT[0], *BF16):
        _split(job, case)
    assert all(res[SPLIT[1]]["weights"] == 0 for res in job.results.values())


@pytest.mark.slow  # 16 s; two stages (the default suite) run the same paths
def test_offload_changes_nothing_on_four_processes(tmp_path):
    four = _offload_cases("gpt:4:1:1f1b:ipc:fixed")
    replicas = ["gpt:2:2:1f1b:tcp:varied:eager:none", "gpt:2:2:1f1b:tcp:varied:eager:both"]
    tied = ["hf:2:2:1f1b:tcp:varied:eager:none:fp32:microbatch"]  # each replica's own pieces
    half = _offload_cases("gpt:4:1:message-driven:ipc:fixed", ("none", "both"), "fp16")
    cases = four + replicas + tied
    job = launch(4, "equivalence.py", cases + half, tmp_path, timeout=240)
    _check(job, cases, 4)
    for group in (four, replicas, half):
        _identical(job, group)
        _paged(job, group[-1])
