"""Two stages as two processes on one GPU train exactly like one process.

Each job runs tests/workers/gpu_pipeline.py under `myelin run -n 2`, with one GPU visible,
so both ranks share it. NCCL refuses two ranks on one GPU, so these jobs create the default
process group with gloo first (`--pg gloo`); whether the Trainer manages that by itself is
`test_two_ranks_share_one_gpu_without_help`, kept apart so that each verdict stands alone.

fp32 with deterministic kernels must match bit for bit: the stages run the same kernels
on the same shapes as the one-process reference, and the activations and gradients cross
between them as exact bytes. bf16 runs the default (flash) attention, whose backward adds
with atomics, so it matches within BF16_LOSS_TOL and BF16_PARAM_TOL.
"""

from __future__ import annotations

import pytest

from tests._procs import launch
from tests.gpu._gpu import one_gpu_env

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]  # CUDA start-up in every rank

STEPS, LR = 5, 3e-3  # as in the worker
BF16_LOSS_TOL = 0.02  # about 0.4% of the starting loss, ln(128) = 4.85
# A few bf16 steps apart at 1.0 (LayerNorm weights), or every AdamW step's full size apart.
BF16_PARAM_TOL = max(4 * 2.0**-7, STEPS * LR * 2)
SCALAR_BLOCKS = 4096  # bytes of pinned blocks torch may add for its own scalar reads
HOST_TOL = 1e-5  # the "host" optimizer steps on the CPU, whose kernels round differently

EXACT = [  # equal to the reference bit for bit
    "gpt:2:1:fp32:none:1f1b",
    "gpt:2:1:fp32:none:message-driven",
    "gpt:2:1:fp32:none:gpipe",
    "gpt:2:1:fp32:act:gpipe",
    "gpt:2:1:fp32:stream:gpipe",
    "gpt:2:1:fp32:both:gpipe",
]
HOST = ["gpt:2:1:fp32:host:gpipe", "gpt:2:1:fp32:bothhost:gpipe"]
TIED = ["hf:2:1:fp32:none:1f1b"]  # GPT-2's tied embedding: gradients summed across stages


def _ok(job, nproc=2):
    assert job.returncode == 0, job.output[-6000:]
    assert sorted(job.results) == list(range(nproc)), job.output[-3000:]


@pytest.fixture(scope="module")
def fp32_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp32")
    args = ["--pg", "gloo", "--deterministic", "--count-pins", *EXACT, *HOST, *TIED]
    job = launch(2, "gpu_pipeline.py", args, tmp, timeout=500, env=one_gpu_env())
    _ok(job)
    return job


def test_two_stages_on_one_gpu_equal_one_process_bit_for_bit(fp32_job):
    for rank, res in fp32_job.results.items():
        for case in EXACT:
            got = res[case]
            assert got["device"].startswith("cuda"), (case, rank, got["device"])
            assert got["losses"] == got["ref_losses"], (case, rank, got["losses"])
            assert got["param_equal"], (case, rank, got["param_diff"])
        # schedules and offloads change the order and the place, never the bits
        assert len({res[c]["digest"] for c in EXACT}) == 1, {c: res[c]["digest"] for c in EXACT}


def test_offload_on_or_off_is_the_same_training_on_gpu(fp32_job):
    for rank, res in fp32_job.results.items():
        none, act, both = (res[f"gpt:2:1:fp32:{o}:gpipe"] for o in ("none", "act", "both"))
        assert act["digest"] == none["digest"] == both["digest"], rank
        if rank == 0:  # stage 0 pages out under GPipe; the last stage's backward follows at once
            assert act["memory"]["activations_offloaded_total_bytes"] > 0, act["memory"]
            assert both["memory"]["prefetch_hits"] + both["memory"]["prefetch_misses"] > 0
        assert both["memory"]["optimizer_mode"] == "stream"  # True means "stream" on a GPU
        assert both["memory"]["device_peak_measured_by"] == "torch.cuda"


def test_host_optimizer_on_gpu_matches_within_cpu_rounding(fp32_job):
    for rank, res in fp32_job.results.items():
        for case in HOST:
            got = res[case]
            assert got["memory"]["optimizer_mode"] == "host", got["memory"]
            assert got["param_diff"] <= HOST_TOL, (case, rank, got["param_diff"])
            for a, b in zip(got["losses"], got["ref_losses"], strict=True):
                assert abs(a - b) <= HOST_TOL, (case, rank, got["losses"], got["ref_losses"])
        # paging activations does not change the host update's bits either
        assert res[HOST[0]]["digest"] == res[HOST[1]]["digest"], rank


def test_tied_embedding_across_stages_on_one_gpu(fp32_job):
    for rank, res in fp32_job.results.items():
        got = res[TIED[0]]
        assert got["param_diff"] <= 1e-5, (rank, got["param_diff"])
        for a, b in zip(got["losses"], got["ref_losses"], strict=True):
            assert abs(a - b) <= 1e-5, (rank, got["losses"], got["ref_losses"])


def test_no_pinning_in_the_hot_path_after_the_first_step(fp32_job):
    """After step 1 nothing asks for pinned memory: no Tensor.pin_memory or
    pin_memory=True factory call, no new block in torch's pinned allocator,
    no new slab in myelin's host pool or send-staging pool (4 more steps and an eval)."""
    for rank, res in fp32_job.results.items():
        for case in EXACT + HOST:  # TIED runs gloo's CUDA all-reduce, which stages through
            pins = res[case]["pins"]  # pinned memory of its own
            assert pins["pinning_calls"] == 0, (case, rank, pins)
            assert not any(pins["pool_growth"].values()), (case, rank, pins)
            # no new pinned block but torch's own scalar staging: `.item()` reads through a
            # pinned scalar from torch's cache, which an H200 run saw grow by two blocks of 5
            # bytes in all (a page or a bucket here is 128 KiB or more)
            grown = pins["host_allocator"].get("allocated_bytes.allocated", 0)
            assert grown <= SCALAR_BLOCKS, (case, rank, pins)


def test_two_stages_on_one_gpu_in_bf16_within_tolerance(tmp_path):
    cases = ["gpt:2:1:bf16:none:1f1b", "gpt:2:1:bf16:both:gpipe", "gpt:2:1:bf16:host:gpipe"]
    args = ["--pg", "gloo", *cases]
    job = launch(2, "gpu_pipeline.py", args, tmp_path, timeout=300, env=one_gpu_env())
    _ok(job)
    for rank, res in job.results.items():
        for case in cases:
            got = res[case]
            assert got["memory"]["precision"] == "bf16"
            for a, b in zip(got["losses"], got["ref_losses"], strict=True):
                assert abs(a - b) <= BF16_LOSS_TOL, (case, rank, got["losses"], got["ref_losses"])
            assert got["param_diff"] <= BF16_PARAM_TOL, (case, rank, got["param_diff"])


def test_a_send_waits_for_its_device_to_host_copy(tmp_path):
    """Every staging buffer holds NaN until its copy lands, and the copy stream is held
    back ~10 ms before each copy: a message that left before its copy finished would carry
    NaN to the other stage. Results must equal the reference exactly."""
    cases = ["gpt:2:1:fp32:none:1f1b", "gpt:2:1:fp32:none:gpipe"]
    args = ["--pg", "gloo", "--deterministic", "--poison-send", *cases]
    job = launch(2, "gpu_pipeline.py", args, tmp_path, timeout=300, env=one_gpu_env())
    _ok(job)
    for rank, res in job.results.items():
        for case in cases:
            got = res[case]
            assert got["losses"] == got["ref_losses"], (case, rank, got["losses"])
            assert got["param_equal"] and got["finite"], (case, rank, got["param_diff"])


def test_the_send_poison_catches_a_send_that_does_not_wait(tmp_path):
    """The check of the check above: with CUDA events that claim to be done at once, the
    loop sends before the copy lands, and the poison must show."""
    cases = ["gpt:2:1:fp32:none:1f1b"]
    args = ["--pg", "gloo", "--deterministic", "--poison-send", "--break-events", *cases]
    job = launch(2, "gpu_pipeline.py", args, tmp_path, timeout=300, env=one_gpu_env())
    _ok(job)
    got = [res[cases[0]] for res in job.results.values()]
    assert any(g["losses"] != g["ref_losses"] or not g["finite"] for g in got), (
        "a send that did not wait for its copy went unnoticed: the poison test above "
        "cannot catch the bug it is for (lengthen the copy stream's delay)"
    )


def test_two_ranks_share_one_gpu_without_help(tmp_path):
    """A user's script makes no process group: the Trainer makes one. With both ranks on
    one GPU it must not ask NCCL for a communicator (NCCL refuses two ranks on one GPU:
    "Duplicate GPU detected"), so 2 stages on one GPU must start and train."""
    cases = ["gpt:2:1:fp32:none:1f1b"]
    args = ["--pg", "myelin", *cases]
    job = launch(2, "gpu_pipeline.py", args, tmp_path, timeout=300, env=one_gpu_env())
    assert job.returncode == 0, (
        "2 ranks on one GPU could not train with the Trainer's own process group:\n"
        + job.output[-6000:]
    )
    for rank, res in job.results.items():
        got = res[cases[0]]
        assert got["param_diff"] <= 1e-5, (rank, got["param_diff"])
