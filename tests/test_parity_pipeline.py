"""Issue 17 across processes: one 2-process job (tests/workers/parity.py) trains each case
with myelin and records it beside plain PyTorch in one process; the tests read its results.
About 20 s on 2 cores."""

from __future__ import annotations

import pytest

from tests._procs import launch


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    job = launch(2, "parity.py", [], tmp, timeout=240)
    assert job.returncode == 0, job.output[-5000:]
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    return job.results


def case(job, name, rank):
    got = job[rank][name]
    assert "error" not in got, f"rank {rank}, {name}:\n{got.get('trace', got['error'])}"
    return got


@pytest.mark.parametrize("name", ["export_bf16", "export_bf16_host", "export_fp16"])
def test_state_dict_of_a_half_precision_pipeline_is_its_fp32_masters(job, name):
    """17.1: every stage's weights come back whole, as the fp32 masters."""
    got = case(job, name, 0)
    assert got["keys_match"] and got["dtypes"] == ["torch.float32"]
    assert not got["nan"]
    assert got["unequal"] == []


def test_every_stage_and_replica_draws_its_own_dropout_masks(job):
    """17.2: masks differ between stages and between replicas, and repeat run to run."""
    stage0, stage1 = (case(job, "dropout", r) for r in (0, 1))
    (first,), (second,) = stage0["pipeline"], stage1["pipeline"]
    assert len(first) == len(second) == 8
    assert sum(a == b for a, b in zip(first, second)) == 0
    for got in (stage0, stage1):
        assert got["pipeline_again"] == got["pipeline"]
        assert got["pipeline_other_seed"] != got["pipeline"]
    replica0, replica1 = stage0["replicas"], stage1["replicas"]
    for a, b in zip(replica0, replica1):
        assert sum(x == y for x, y in zip(a, b)) == 0


def test_a_stage_that_begins_with_an_inplace_op_trains_as_one_process(job):
    """17.3: ReLU(inplace=True) first on stage 1, losses equal to plain PyTorch."""
    got = case(job, "inplace", 1)
    assert got["stage_begins_with"] == "ReLU"
    for rank in (0, 1):
        got = case(job, "inplace", rank)
        assert got["losses"] == got["want"]


@pytest.mark.parametrize("name", ["clip_stages", "clip_stages_host"])
def test_max_grad_norm_over_stages_equals_clip_grad_norm(job, name):
    """17.5: one global norm over both stages (and every offload bucket)."""
    for rank in (0, 1):
        got = case(job, name, rank)
        assert got["losses"] == got["want"]
    assert case(job, name, 0)["param_diff"] == 0.0


def test_max_grad_norm_sums_the_norms_in_the_models_order_not_its_layers(job):
    """clip_grad_norm_ over model.parameters() sums in registration order: a model that
    registers its head first is clipped bit for bit as one process clips it."""
    for rank in (0, 1):
        got = case(job, "clip_head_first", rank)
        assert got["losses"] == got["want"]
    assert case(job, "clip_head_first", 0)["unequal"] == []


def test_a_frozen_weight_tied_across_stages_trains_in_bf16_as_one_process(job):
    for rank in (0, 1):
        got = case(job, "frozen_tied_bf16", rank)
        assert got["losses"] == got["want"]
    assert case(job, "frozen_tied_bf16", 0)["unequal"] == []


def test_max_grad_norm_over_replicas_equals_clip_grad_norm(job):
    """17.5: the norm of the gradient averaged over replicas (the rounding of the average
    differs from one process's, so to a tolerance)."""
    for rank in (0, 1):
        got = case(job, "clip_replicas", rank)
        assert got["losses"] == pytest.approx(got["want"], abs=1e-6)
    assert case(job, "clip_replicas", 0)["param_diff"] < 1e-6
