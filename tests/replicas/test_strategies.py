"""The replica strategies in real multi-process runs (4 ranks on loopback), and their
settings checked before any process starts (daso_easgd.md section 5)."""

import functools
import math
import re

import pytest
import torch

import myelin
from myelin.checkpoint import _strategy_state
from myelin.replicas import Strategy, own_state
from myelin.replicas.daso import merge_stale
from tests._procs import launch


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """One 4-rank job for DASO, sync EASGD and AllReduce's overlap, checkpoints of another
    strategy or layout, clipping per replica, tied weights (about 30-45 s on 2 cores)."""
    cases = ["daso", "easgd", "overlap", "foreign", "clip", "tied"]
    job = launch(4, "replicas.py", cases, tmp_path_factory.mktemp("four"), timeout=360)
    assert job.returncode == 0, job.output[-4000:]
    assert sorted(job.results) == [0, 1, 2, 3]
    return job.results


def test_sync_settings_are_checked_before_any_work():
    with pytest.raises(myelin.ConfigError, match="sync='ring' must be one of"):
        myelin.PipelineConfig(sync="ring")
    with pytest.raises(myelin.ConfigError, match=r"DASO\(node_size=2\): data_parallel=3"):
        myelin.PipelineConfig(data_parallel=3, sync=myelin.DASO(node_size=2))
    with pytest.raises(myelin.ConfigError, match=r"DASO\(downcast=\['bf16'\]\)"):
        myelin.DASO(downcast=["bf16"])
    with pytest.raises(myelin.ConfigError, match=r"EASGD\(tau=0\)"):
        myelin.EASGD(tau=0)
    with pytest.raises(myelin.ConfigError, match=r"EASGD\(mode='ring'\)"):
        myelin.EASGD(mode="ring")
    with pytest.raises(myelin.ConfigError, match=r"alpha \+ beta = alpha x \(replicas \+ 1\) < 2"):
        myelin.PipelineConfig(data_parallel=4, sync=myelin.EASGD(alpha=0.6))
    # beta = 1.8 < 2, but alpha + beta = 2.25: |mean - center| grows 1.25x a round
    with pytest.raises(myelin.ConfigError, match=r"\(here 2.25\)"):
        myelin.PipelineConfig(data_parallel=4, sync=myelin.EASGD(alpha=0.45))
    myelin.PipelineConfig(data_parallel=4, sync=myelin.EASGD(alpha=0.39))  # 1.95: stable
    with pytest.raises(myelin.ConfigError, match=r"DASO\(stability_level=2\)"):
        myelin.DASO(stability_level=2)
    with pytest.raises(myelin.ConfigError, match=r"fp16's loss scaling skips"):
        myelin.Trainer(
            torch.nn.Linear(2, 2),
            torch.optim.SGD,
            torch.nn.functional.mse_loss,
            sync=myelin.EASGD(momentum=0.9),
            precision="fp16",
        )
    with pytest.raises(myelin.ConfigError, match=r"AllReduce\(bucket_mb=0\) must be > 0"):
        myelin.AllReduce(bucket_mb=0)
    with pytest.raises(myelin.ConfigError, match=r"AllReduce\(overlap='no'\)"):
        myelin.AllReduce(overlap="no")
    assert isinstance(myelin.PipelineConfig(sync="daso").sync, myelin.DASO)
    assert isinstance(myelin.PipelineConfig().sync, myelin.AllReduce)


def test_allreduce_bucket_mb_must_be_finite():
    """An infinite bucket passed the check, then overflowed when the strategy was built."""
    with pytest.raises(myelin.ConfigError, match=r"AllReduce\(bucket_mb=inf\) must be finite"):
        myelin.AllReduce(bucket_mb=float("inf"))
    with pytest.raises(myelin.ConfigError, match=r"AllReduce\(bucket_mb=nan\) must be > 0"):
        myelin.AllReduce(bucket_mb=float("nan"))
    myelin.AllReduce(bucket_mb=1e6)  # large and finite: fine


def test_a_strategy_reads_only_its_own_checkpointed_state():
    """State is tagged with its strategy's name; an untagged (older) one is recognised by
    a key only its strategy saves; another strategy's is absent (DASO's into EASGD was a
    bare KeyError 't')."""
    easgd = {"strategy": "easgd", "local": torch.zeros(1), "t": 3, "exchanges": 1}
    daso = {"strategy": "daso", "schedule": None, "pending": {}, "local": torch.zeros(1)}
    assert own_state(easgd, "easgd", "t") is easgd and own_state(daso, "easgd", "t") is None
    assert own_state(daso, "daso", "schedule") is daso
    assert own_state(easgd, "daso", "schedule") is None
    old_daso = {k: v for k, v in daso.items() if k != "strategy"}
    assert own_state(old_daso, "easgd", "t") is None
    assert own_state(old_daso, "daso", "schedule") is old_daso
    assert own_state({}, "easgd", "t") is None
    hogbatch = Strategy()  # its state is untagged; another's tagged state never reaches it
    assert _strategy_state(hogbatch, easgd) == {}
    assert _strategy_state(hogbatch, {"controller": {}}) == {"controller": {}}


@pytest.mark.parametrize(
    "optimizer,got",
    [
        (functools.partial(torch.optim.AdamW, lr=3e-3), "got AdamW, an adaptive optimizer"),
        (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), r"got SGD\(momentum=0.9"),
    ],
)
def test_measgd_momentum_needs_the_local_sgd_update(optimizer, got):
    """MEASGD's momentum is on the local SGD update: on AdamW (the bench's old MEASGD,
    which never reached the target) or SGD's own momentum it would be a second one."""
    with pytest.raises(myelin.ConfigError, match=r"EASGD\(momentum=0.5\) is MEASGD's") as err:
        myelin.Trainer(
            torch.nn.Linear(2, 2),
            optimizer,
            torch.nn.functional.mse_loss,
            sync=myelin.EASGD(momentum=0.5),
        )
    assert re.search(got, str(err.value)) and "torch.optim.SGD(lr=...)" in str(err.value)
    plain = myelin.Trainer(  # plain SGD is MEASGD's update; momentum 0 keeps any optimizer
        torch.nn.Linear(2, 2),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        sync=myelin.EASGD(momentum=0.5),
    )
    plain.close()
    adam = myelin.Trainer(
        torch.nn.Linear(2, 2), optimizer, torch.nn.functional.mse_loss, sync="easgd"
    )
    adam.close()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """One 2-rank job: DASO at its edges, and with a parameter left without a gradient."""
    cases = ["daso_edges", "daso_unused", "bn_buffers", "save_in_view", "half"]
    job = launch(2, "replicas.py", cases, tmp_path_factory.mktemp("two"), timeout=240)
    assert job.returncode == 0, job.output[-4000:]
    return job.results


def test_daso_saves_before_any_plan_and_plans_uneven_loaders_by_the_shortest(two):
    got = [two[r]["daso_edges"] for r in (0, 1)]
    assert [g["sends_before"] for g in got] == [0, 0]  # stats before the epoch length is known
    # the ranks' loaders hold 4 and 6 batches: both plan DASO's epochs on the 4 they share
    assert [(g["steps"], g["epoch_steps"]) for g in got] == [(8, 4), (8, 4)]
    assert got[0]["params"] == got[1]["params"]  # the last epoch ends on a blocking average
    assert all("keeps the epoch length it planned (4 steps)" in g["second_fit"][0] for g in got)


def test_daso_leaves_a_parameter_without_a_gradient_alone_and_refuses_sparse_ones(two):
    for r in (0, 1):
        got = two[r]["daso_unused"]
        assert got["moved"] == {"daso": 0.0, "allreduce": 0.0}  # no weight decay without grad
        assert "sparse gradient" in got["sparse_error"] and "node_size=1" in got["sparse_error"]


@pytest.mark.parametrize("sync", ["allreduce", "easgd", "daso"])
def test_the_model_read_under_data_parallel_holds_replica_zeros_buffers(two, sync):
    """BatchNorm's running statistics come from each replica's own batches; evaluation
    and state_dict() read one model: replica 0's buffers, on every replica (DDP's rule)."""
    a, b = two[0]["bn_buffers"][sync], two[1]["bn_buffers"][sync]
    assert a["buffers"] == b["buffers"]
    assert b["own_differ"] and not a["own_differ"]  # replica 1 took replica 0's
    assert a["state_buffers"] == a["buffers"][:2]
    assert a["eval"] == b["eval"] == pytest.approx(a["reference"], rel=1e-6)


@pytest.mark.parametrize("sync", ["easgd", "daso"])
def test_a_save_inside_the_model_view_keeps_each_replicas_own_parameters(two, sync):
    for r in (0, 1):
        got = two[r]["save_in_view"][sync]
        assert got["differ"] and got["resumed_own"]  # not the center the view held


def test_a_parameter_one_replica_used_with_a_zero_gradient_moves_alike_on_every_replica(two):
    """Rank 0's gradient of the head is zeros, rank 1 has none: the head is used (DDP's
    rule), so AdamW's weight decay moves it on both replicas, and they stay equal (the
    replica without a gradient left it alone while the other decayed it)."""
    a, b = two[0]["daso_unused"]["partly"], two[1]["daso_unused"]["partly"]
    for name in ("daso", "allreduce", "allreduce_after"):
        assert a[name]["aux"] == b[name]["aux"], name
        assert a[name]["moved"] > 0 and b[name]["moved"] > 0, name


@pytest.mark.parametrize("wait,nodes", [(0, 2), (1, 2), (3, 4), (2, 1)])
def test_daso_merge_formula(wait, nodes):
    x = torch.tensor([1.0, -2.0, 0.5, 8.0])
    total = torch.tensor([3.0, 1.0, -4.0, 2.0])
    w = 2 * wait if wait else 1
    p = x.clone()
    merge_stale([p], total, wait, nodes)
    assert torch.allclose(p, (w * x + total) / (w + nodes), rtol=0, atol=1e-6)


def test_daso_warmup_equals_allreduce_sgd(four):
    for r in four.values():
        assert r["daso"]["warmup_max_diff"] < 1e-6


def test_daso_and_easgd_steps_return_the_replicas_own_loss_without_a_collective(four):
    """Their replicas hold different models between exchanges: step() returns this
    replica's loss (no per-step barrier), DASO's plateau rule averages once per epoch,
    sync EASGD's steps make only their rounds' all-reduces, fit's rows average."""
    for r in four.values():
        d, e = r["daso"], r["easgd"]
        assert d["own_loss"] == pytest.approx(d["reference_loss"], rel=1e-5, abs=1e-6)
        assert d["loss_traffic"]["count"] == 3 and d["loss_traffic"]["bytes"] == 3 * 8
        assert e["own_loss"] == e["reference_loss"]  # alpha = 0: bit for bit its own SGD
        assert e["step_collectives"] == ["all_reduce"] * e["exchanges"]  # t = 0, 3, 6
        for row, mean in zip(e["fit_rows"], e["fit_means"], strict=True):
            assert row == pytest.approx(mean, rel=1e-12)  # [loss, loss_avg]
        assert e["fit_own_differ"]
    losses = {tuple(r["daso"]["own_loss"]) for r in four.values()}
    assert len(losses) == 4  # four replicas, four batches, four losses
    speeds = [r["easgd"]["fit_tokens_per_s"] for r in four.values()]
    assert all(s == pytest.approx(speeds[0], rel=1e-12) for s in speeds), speeds  # one number


def test_daso_ranks_identical_at_every_blocking_average(four):
    for r in four.values():
        d = r["daso"]
        assert d["identical"] and all(d["identical"])
        assert d["differ_mid"] > 0  # between them the nodes do drift apart
        assert d["bf16_representable"] and d["downcast"] == "torch.bfloat16"
        assert d["view_is_synced"] and d["view_restores"]
        assert d["kinds"][0] == ["Send"] and d["kinds"][1] == ["Merge"]
        assert d["kinds"][5] == ["Send", "Merge", "Average"]  # the epoch's last step
        assert all(k == ["Send", "Average"] for k in d["kinds"][12:])  # cool-down
    # only one rank per node sends across nodes; every rank takes part in its node
    sends = sorted(r["daso"]["bytes_global"] for r in four.values())
    assert sends[0] == sends[1] and sends[2] == sends[3] and sends[0] != sends[2]


def test_daso_resumes_exactly_across_a_pending_send(four):
    for r in four.values():
        d = r["daso"]
        assert d["pending_at_save"] and d["resumed"] == d["full"]


def test_daso_resumed_as_other_nodes_starts_its_sends_afresh_from_the_synced_model(four):
    """Saved as 2 nodes of 2 with a send pending, resumed as 1 node of 4 and as 4 of 1:
    the pending sum (over the old nodes) would scale the weights; it is dropped, said so,
    and every replica resumes from the synchronised parameters."""
    for r in four.values():
        for node_size in ("4", "1"):
            got = r["daso"]["regrouped"][node_size]
            assert got["loaded_is_synced"] and got["losses_finite"], node_size
            assert len(got["warning"]) == 1, got["warning"]
            assert "node_size=2" in got["warning"][0]
            assert f"node_size={node_size}" in got["warning"][0]


def test_daso_in_a_pipeline_runs_per_stage(four):
    for r in four.values():
        d = r["daso"]
        assert d["pipeline_same_at_epoch_end"] == [True, True]
        assert d["pipeline_stats"]["sends"] == 4 and d["pipeline_stats"]["local_bytes"] == 0


def test_easgd_conservation_and_consensus_at_eta_zero(four):
    e = four[0]["easgd"]
    assert max(e["totals"]) - min(e["totals"]) < 1e-4 * abs(e["totals"][0])
    ratios = [b / a for a, b in zip(e["spreads"], e["spreads"][1:], strict=False)]
    assert all(math.isclose(q, 1 - e["alpha"], rel_tol=2e-3) for q in ratios)


def test_easgd_reductions(four):
    for r in four.values():
        e = r["easgd"]
        assert e["alpha0_equal"] and e["alpha0_center_still"]  # alpha = 0: local SGD
        assert e["momentum_diff"] < 1e-5  # MEASGD's mu == SGD momentum, elastic outside v
        assert e["exchanges"] == (7 - 1) // 3 + 1  # t = 0, 3, 6
        assert e["bytes"] == e["exchanges"] * e["numel"] * 4
        # a sync round's all-reduce is not waited for at its step: it runs through the
        # round, and the center takes it when needed (the next pull, reading the center)
        assert e["flights"] == [True] * 7 and e["settled"]


def test_the_profile_shows_each_strategys_communication(four):
    """EASGD's exchanges and AllReduce's buckets: bytes = parameter bytes x exchanges."""
    rows = four[0]["easgd"]["profile_rows"]  # every rank's, as rank 0's report has them
    assert len(rows) == 4
    for row in rows:
        e = four[0]["easgd"]
        assert row["strategy"] == "easgd"
        exchange = row["traffic"]["exchange"]
        assert exchange["bytes"] == e["exchanges"] * e["numel"] * 4
        assert exchange["count"] == e["exchanges"] and exchange["wait_s"] >= 0
        assert "loss" not in row["traffic"]  # the steps' losses are each replica's own
    text = four[0]["easgd"]["profile_text"]
    assert "replica communication" in text
    assert len([x for x in text.splitlines() if " easgd " in x and " exchange " in x]) == 4
    for r in four.values():
        on = r["overlap"]["fp32:True"]
        grads = on["traffic"]["gradients"]
        assert grads["bytes"] == 3 * on["numel"] * 4  # 3 steps of fp32 gradients
        assert grads["count"] == on["stats"]["buckets"]
        # the loss and each parameter's had-a-gradient flag ride the step's last bucket
        loss = on["traffic"]["loss"]
        assert loss["count"] == 0 and loss["bytes"] == 3 * (1 + on["params"]) * 4


def test_easgd_sync_bitwise_reproducible_with_random_delays(four):
    for r in four.values():
        e = r["easgd"]
        assert e["runs"][0] == e["runs"][1] and e["centers_equal"]
    assert len({r["easgd"]["runs"][0][1] for r in four.values()}) == 1  # one center
    assert len({r["easgd"]["runs"][0][0] for r in four.values()}) == 4  # own x_i
    assert four[0]["easgd"]["state_dict_is_center"]


def test_easgd_sync_downcast_sends_half_the_bytes_and_keeps_one_center(four):
    for r in four.values():
        for dtype, tol in (("fp16", 2e-3), ("bf16", 2e-2)):
            e = r["easgd"]
            assert e[f"{dtype}_runs"][0] == e[f"{dtype}_runs"][1]  # reproducible
            assert e[f"{dtype}_centers_equal"]
            sent, per_exchange = e[f"{dtype}_bytes"]
            assert sent == per_exchange * e[f"{dtype}_numel"]  # 2 bytes a parameter
            # rounded differences: near the fp32 run, relative to how far the center moved
            assert 0 < e[f"{dtype}_off"] < tol, e[f"{dtype}_off"]
    assert len({r["easgd"]["fp16_runs"][0][1] for r in four.values()}) == 1


def test_easgd_downcast_is_checked_before_any_work():
    with pytest.raises(myelin.ConfigError, match=r"EASGD\(downcast='fp8'\): must be one of"):
        myelin.EASGD(downcast="fp8")
    with pytest.raises(myelin.ConfigError, match=r"downcast='fp16'\) needs mode='sync'"):
        myelin.EASGD(mode="async", downcast="fp16")
    assert myelin.EASGD(downcast="bf16").downcast == "bf16"


def test_allreduce_overlapped_with_the_last_backward_changes_no_bit(four):
    for r in four.values():
        o = r["overlap"]
        for variant in ("fp32", "bf16", "offload"):
            on, off = o[f"{variant}:True"], o[f"{variant}:False"]
            assert on["digest"] == off["digest"] and on["losses"] == off["losses"]
            buckets = on["stats"]["buckets"] // 3
            assert buckets >= 4 and off["stats"]["buckets"] == 3 * buckets
            assert off["stats"]["buckets_overlapped"] == 0
            assert on["stats"]["global_bytes"] == 3 * on["numel"] * 4  # fp32 gradients
            # the last step (2 microbatches): buckets last to first; those final before
            # the first layer's gradient went out during the last backward, before it ended;
            # the first bucket on the first stage, final only at the backward's end, carries
            # no hooks and leaves after it
            launches = [e for e in on["events"] if e[0] != "first"]
            assert launches == [["backward", b] for b in reversed(range(1, buckets))] + [
                ["after", 0]
            ]
            launches = [e for e in off["events"] if e[0] != "first"]
            assert launches == [["after", b] for b in reversed(range(buckets))]
            firsts = [i for i, e in enumerate(on["events"]) if e[0] == "first"]
            assert firsts[0] == 0 and len(firsts) == 2  # the first microbatch launches nothing
            assert firsts[1] >= 3  # at least 2 buckets launched before the backward's end
            assert on["events"][-1] == ["after", 0]
            assert on["stats"]["buckets_overlapped"] == on["stats"]["buckets"] - 3  # 3 steps
            assert on["stats"]["steps_overlapped"] == 3 and off["stats"]["steps_overlapped"] == 0
            assert [e[0] for e in off["events"][:2]] == ["first", "first"]  # after: at the end


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One worker: sync, async and hogwild EASGD, async under CURVE, async resumed from an
    AllReduce checkpoint (about 20-40 s: 4 hubs)."""
    cases = ["one", "foreign_async"]
    job = launch(1, "replicas.py", cases, tmp_path_factory.mktemp("one"), timeout=240)
    assert job.returncode == 0, job.output[-4000:]
    return {**job.results[0]["one"], "foreign_async": job.results[0]["foreign_async"]}


def test_easgd_one_worker_async_and_hogwild_equal_sync(one):
    finals = one["finals"]
    assert finals["async"] == finals["sync"] and finals["hogwild"] == finals["sync"]
    assert finals["async-curve"] == finals["sync"] and one["curve_client"]  # under CURVE too
    assert one["exchanges"] == 3  # at t = 0, 2, 4
    assert one["hub_requests"] == 1 + 3 + 3  # init, exchanges, 3 reads of the center
    assert one["evaluate_reads"] == 1


def test_easgd_evaluation_state_dict_and_resume_use_the_center(one):
    for mode in ("sync", "async", "hogwild"):
        assert one[f"{mode}_eval"] == pytest.approx(one[f"{mode}_eval_center"], abs=1e-7)
        assert one[f"{mode}_state_dict_is_center"]
        assert one[f"{mode}_save_pretrained_is_center"]
    assert one["resumed"] == one["full"]  # exact, momentum and center included


def test_hub_exchanges_conserve_and_its_death_is_peer_lost_everywhere(tmp_path):
    """Four workers on one hub (about 50 s on 2 cores: 3 hubs start, one is killed)."""
    job = launch(4, "replicas.py", ["hub"], tmp_path, timeout=240)
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-4000:]
    for r in job.results.values():
        h = r["hub"]
        for mode in ("async", "hogwild"):
            before, after, exchanges = h[mode]
            assert after == pytest.approx(before, rel=1e-5) and exchanges == 4
            assert h[f"{mode}_traffic"] == ["exchange"]  # no loss average per step
            assert h[f"{mode}_view_is_final"]  # replica 0's view waited for the others
        assert h["error"] == "PeerLostError", h  # ranks 1-3: rank 0's goodbye relays it
        assert h["after_s"] < 15  # peer_timeout_s is 20 s; the old behaviour was a 300 s wait
        assert "hub" in h["message"]


# async: 9 s (a hub); the `one` job resumes an async checkpoint exactly by default
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_an_easgd_checkpoint_of_a_model_with_layers_resumes_exactly(tmp_path, mode):
    """The checkpoint's model (the center) is stored by layer key, as every other shard's
    weights (a GPT, whose keys in the module differ from its layers', did not resume),
    and an async run puts it back in the hub (which kept the initial weights)."""
    from myelin.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)
    x = torch.randint(0, 32, (6, 4, 9), generator=torch.Generator().manual_seed(0))

    def trainer(**kw):
        torch.manual_seed(0)
        sync = myelin.EASGD(tau=2, alpha=0.3, mode=mode)
        return myelin.Trainer(GPT(cfg), torch.optim.SGD, lm_loss, sync=sync, timeout=60, **kw)

    with trainer() as t:
        full = [t.step(b[:, :-1], b[:, 1:]) for b in x]
    with trainer() as t:
        for b in x[:3]:
            t.step(b[:, :-1], b[:, 1:])
        t.save(tmp_path)
    with trainer(resume=tmp_path) as t:
        assert [t.step(b[:, :-1], b[:, 1:]) for b in x[3:]] == full[3:]


def test_a_checkpoint_without_the_strategys_state_resumes_as_its_model(four):
    """An AllReduce checkpoint resumed under sync EASGD and DASO, DASO's under EASGD and
    EASGD's under DASO, EASGD's in another layout: the model (state_dict(), evaluation,
    EASGD's center, DASO's synchronised weights) is the checkpoint's, not the weights the
    trainer was built with, and so is what the next checkpoint holds."""
    for r in four.values():
        f = r["foreign"]
        assert not f["trained_is_init"]
        for name in ("easgd", "daso", "daso_to_easgd", "easgd_to_daso", "layout"):
            assert f[f"{name}_model_is_checkpoint"], name
        # the next checkpoint holds the model as it was at its save, not the initial weights
        assert f["easgd_next_checkpoint"] == [True, False]
        assert f["daso_next_checkpoint"] == [True, False]
        assert f["layout_moved"]


def test_daso_without_an_epoch_length_refuses_step_before_any_work(four):
    for r in four.values():
        d = r["foreign"]["daso_no_epoch_length"]
        assert "DASO needs the epoch length" in d["error"]
        assert d["steps_before"] == 0 and d["steps_after"] == 2  # still usable: fit trains


def test_max_grad_norm_clips_each_replica_by_its_own_norm(four):
    """EASGD(alpha=0) is each replica's own clip_grad_norm_ + SGD, bit for bit, and its clip
    adds no collective (one all-reduce a step: the exchange); with two stages the norm
    spans the replica's pipeline; DASO's warm-up clips each node's mean gradient by its
    norm, then averages the nodes (replica 0's norm for all was the old behaviour)."""
    for r in four.values():
        c = r["clip"]
        assert c["easgd_own"]
        assert c["easgd_all_reduces"] == [3, 3]
        assert c["pipeline_own_diff"] < 1e-6
        assert c["daso_diff"] < 1e-6


def test_async_easgd_resumed_from_allreduce_takes_the_checkpoint_as_center(one):
    f = one["foreign_async"]
    assert f["center_is_checkpoint"] and f["state_dict_is_checkpoint"]
    assert not f["center_is_init"]


def test_a_weight_tied_across_stages_stays_one_weight(four):
    """Async EASGD's hub serves each stage's slot in its own order, and each stage's
    reduction rounds its own way: the holders' copies stay bit-identical all the same."""
    for r in four.values():
        assert r["tied"] == {"async_ordered": True, "async_ordered_bf16": True,
                             "allreduce_skewed": True}  # fmt: skip


@pytest.mark.slow  # 8 ranks, 5 trainers and 2 hubs: about 40 s on 2 cores
def test_a_weight_tied_across_stages_stays_one_weight_with_four_replicas(tmp_path):
    job = launch(8, "replicas.py", ["tied_all"], tmp_path, timeout=400)
    assert job.returncode == 0, job.output[-4000:]
    for r in job.results.values():
        assert r["tied_all"] == dict.fromkeys(
            ("allreduce", "daso", "sync", "async", "hogwild"), True
        ), r


class _Branchy(torch.nn.Module):
    """A trunk used every step and a side branch used only when `side` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.side, self.use_side = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2), True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x) + (self.side(x) if self.use_side else 0)


def test_measgd_leaves_a_parameter_without_a_gradient_where_it_is():
    """MEASGD's momentum is the local SGD update's: a parameter without a gradient this
    step stays put, as torch's SGD(momentum) leaves it (the velocity kept it coasting)."""
    torch.manual_seed(0)
    model, ref = _Branchy(), _Branchy()
    ref.load_state_dict(model.state_dict())
    t = myelin.Trainer(model, functools.partial(torch.optim.SGD, lr=0.1),
                       torch.nn.functional.mse_loss,
                       sync=myelin.EASGD(alpha=0.0, momentum=0.9))  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with t:
        for step in range(6):
            x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
            model.use_side = ref.use_side = step < 2  # the side branch idles from step 2
            if step == 2:
                idle = t.module.side.weight.detach().clone()
            t.step(x, y)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
        assert torch.equal(t.module.side.weight, idle)
        for mine, theirs in zip(t.module.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-6, atol=1e-6)


def test_easgd_and_daso_under_bf16_move_the_fp32_masters_the_model_follows(two):
    """Sync EASGD's pulls land in the masters (the next optimizer step copied the masters
    over a pull made on the bf16 weights), equal to a one-process reference; the model
    read is the center; DASO's averages leave every replica's masters equal."""
    for rank in (0, 1):
        e, d = two[rank]["half"]["easgd"], two[rank]["half"]["daso"]
        assert e == {"masters_equal": True, "model_is_masters_rounded": True,
                     "center_equal": True, "replicas_differ": True, "view_is_center": True,
                     "own_back": True}, (rank, e)  # fmt: skip
        assert d["equal_at_sync"] and all(d["equal_at_sync"]), d
        assert d["model_is_masters_rounded"]
        assert "fp16's loss scaling skips" in two[rank]["half"]["fp16_momentum"]
