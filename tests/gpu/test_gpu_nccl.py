"""One GPU per rank: NCCL all-reduce, tied weights over NCCL, stages on their own GPUs.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so every test here needs
as many GPUs as ranks and skips, saying so, where the machine has fewer. Each job runs
tests/workers/gpu_pipeline.py with the Trainer making its own process group
(gloo for CPU tensors, NCCL for CUDA tensors).
"""

from __future__ import annotations

import pytest

from tests._procs import launch
from tests.gpu._gpu import needs_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TOL = 1e-5  # an all-reduce sums replicas in another order than the reference's accumulation


def _ok(job, nproc):
    assert job.returncode == 0, job.output[-6000:]
    assert sorted(job.results) == list(range(nproc)), job.output[-3000:]


def _close(got, case, rank):
    assert got["param_diff"] <= TOL, (case, rank, got["param_diff"])
    for a, b in zip(got["losses"], got["ref_losses"], strict=True):
        assert abs(a - b) <= TOL, (case, rank, got["losses"], got["ref_losses"])


@needs_gpus(2)
def test_data_parallel_over_nccl_matches_one_process(tmp_path):
    cases = ["gpt:1:2:fp32:none:message-driven", "gpt:1:2:fp32:both:gpipe"]
    job = launch(2, "gpu_pipeline.py", ["--deterministic", *cases], tmp_path, timeout=500)
    _ok(job, 2)
    for rank, res in job.results.items():
        assert res[cases[0]]["device"] == f"cuda:{rank}", res[cases[0]]["device"]
        for case in cases:
            _close(res[case], case, rank)
    for case in cases:  # the replicas never drift apart
        assert len({res[case]["digest"] for res in job.results.values()}) == 1, case


@needs_gpus(2)
def test_two_stages_on_two_gpus(tmp_path):
    """Each stage on its own GPU, profiled: results as one process; every rank's CUDA-event
    timings resolve (an event of one device timed against another's raises) and measure
    work; and no rank holds a CUDA context on a GPU it does not use (each costs hundreds
    of MiB on that GPU)."""
    cases = ["gpt:2:1:fp32:none:1f1b", "gpt:2:1:fp32:both:gpipe", "hf:2:1:fp32:none:1f1b"]
    job = launch(2, "gpu_pipeline.py", ["--deterministic", "--profile", *cases], tmp_path, 500)
    _ok(job, 2)
    for rank, res in job.results.items():
        for case in cases:
            got = res[case]
            assert got["device"] == f"cuda:{rank}", (case, got["device"])
            _close(got, case, rank)
            assert got["spans"] and got["busy_s"] > 0, (case, rank, got["spans"], got["busy_s"])
            if got["contexts"] is not None:
                assert got["contexts"] == [rank], (
                    f"rank {rank} on cuda:{rank} holds CUDA contexts on {got['contexts']}"
                )
        assert res[cases[0]]["param_equal"], (rank, res[cases[0]]["param_diff"])


@needs_gpus(4)
def test_two_stages_two_replicas_on_four_gpus(tmp_path):
    cases = ["gpt:2:2:fp32:none:1f1b", "hf:2:2:fp32:both:gpipe"]
    job = launch(4, "gpu_pipeline.py", ["--deterministic", *cases], tmp_path, timeout=500)
    _ok(job, 4)
    for rank, res in job.results.items():
        for case in cases:
            _close(res[case], case, rank)
    for case in cases:
        by_stage: dict[int, set[str]] = {}
        for res in job.results.values():
            by_stage.setdefault(res[case]["stage"], set()).add(res[case]["digest"])
        assert all(len(d) == 1 for d in by_stage.values()), (case, by_stage)
