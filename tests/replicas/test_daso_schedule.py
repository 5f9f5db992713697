"""DASO's schedule without communication: phases, the plateau rule, the S/B cycle, and
which steps send, merge and average (daso_easgd.md section 5, tests 1 and 5)."""

from myelin.replicas.daso_schedule import Average, DasoSchedule, Merge, Send


def schedule(**kw):
    args = dict(
        node_size=2,
        epoch_steps=10,
        total_epochs=30,
        warmup_epochs=1,
        cooldown_epochs=2,
        max_global_skips=8,
        skip_reduction_factor=2,
        local_skip_factor=4,
        stability_level=0.05,
    )
    args.update(kw)
    return DasoSchedule(**args)


def run_epochs(s, losses):
    """(S, ls, B) after each epoch, and every step's events."""
    skips, events = [], []
    for loss in losses:
        for _ in range(s.last_batch + 1):
            events.append(s.advance(loss))
        skips.append(s.skips)
    return skips, events


def test_constant_loss_walks_the_cycle_and_cools_down():
    s = schedule()
    skips, _ = run_epochs(s, [1.0] * 30)
    assert skips[0] == (4, 1, 1)  # the end of warm-up: hard-coded as in Heat
    # The plateau fires on the 3rd non-improving epoch: calls 4, 7, 10, 13, ...
    assert skips[1:3] == [(4, 1, 1)] * 2
    assert skips[3] == (2, 1, 1) and skips[6] == (1, 1, 1)
    assert skips[9] == (8, 2, 2) and skips[12] == (4, 1, 1)
    assert skips[15] == (2, 1, 1)
    assert skips[27] == skips[28] == (0, 0, 0)  # the last 2 epochs block every step


def test_falling_loss_never_changes_the_skips():
    s = schedule()
    skips, _ = run_epochs(s, [0.9**k for k in range(27)])
    assert set(skips) == {(4, 1, 1)}


def test_warmup_blocks_every_step_and_ends_each_epoch_averaged():
    s = schedule(warmup_epochs=2)
    _, events = run_epochs(s, [1.0, 1.0])
    for step in events:  # a blocking send and its average, every step
        assert [type(e) for e in step] == [Send, Average] and step[0].blocking
    assert [step[0].group for step in events[:10]] == [0, 1] * 5  # the sender rotates


def test_cycling_sends_every_S_merges_B_later_and_averages_at_the_epoch_end():
    s = schedule(warmup_epochs=0, epoch_steps=12)
    assert s.skips == (4, 1, 1)
    _, events = run_epochs(s, [1.0])
    sends = [b for b, ev in enumerate(events) for e in ev if isinstance(e, Send)]
    merges = [
        b for b, ev in enumerate(events) for e in ev if isinstance(e, Merge) and e.id is not None
    ]
    averages = [b for b, ev in enumerate(events) for e in ev if isinstance(e, Average)]
    assert sends == [0, 4, 8, 11] and merges == [1, 5, 9] and averages == [11]
    groups = [e.group for ev in events for e in ev if isinstance(e, Send)]
    assert groups == [0, 1, 0, 1]  # rotating, and back to 0 at the next epoch
    assert all(not e.blocking for ev in events[:11] for e in ev if isinstance(e, Send))
    assert s.batch == 0 and s.send_mod == 0 and s.epoch == 1


def test_a_merge_due_at_the_next_send_is_deferred_to_it():
    s = schedule(warmup_epochs=0, epoch_steps=9)
    s.global_skip, s.local_skip, s.batches_to_wait = 2, 1, 1  # B' = S - 1
    _, events = run_epochs(s, [1.0])
    kinds = [[type(e).__name__ for e in ev] for ev in events]
    assert kinds[0] == ["Send"] and kinds[1] == []
    assert kinds[2] == ["Send", "Merge"]  # the merge of step 0's send comes with the next send
    merged = [e.id for ev in events for e in ev if isinstance(e, Merge)]
    assert merged == [0, 1, 2, 3]  # each send merged once, in order


def test_local_skips_turn_node_gradient_averaging_off_between_multiples():
    s = schedule(warmup_epochs=0, epoch_steps=17)
    s.global_skip, s.local_skip, s.batches_to_wait = 8, 2, 2
    syncs = []
    for _ in range(17):
        s.advance(1.0)
        syncs.append(s.local_sync)  # for the next step
    # on (for the next step) before multiples of ls, before a send and before the last step
    assert syncs[:8] == [True, True, False, True, False, True, False, True]
    assert syncs[15] is True


def test_state_round_trips():
    s = schedule(warmup_epochs=0)
    run_epochs(s, [1.0, 1.0, 1.0])
    t = schedule(warmup_epochs=0)
    t.load_state_dict(s.state_dict())
    assert [t.advance(2.0) for _ in range(25)] == [s.advance(2.0) for _ in range(25)]


def test_a_resumed_daso_keeps_the_plan_it_was_saved_under(monkeypatch):
    """Trainer(resume=...) loads the strategy before fit() plans: the epoch length and the
    epoch count fit gave the first run come back with the schedule (before, a resumed run
    had no total, so never cooled down, or no epoch length at all, a ConfigError)."""
    import types

    import torch

    import myelin
    import myelin.replicas.daso as daso
    from myelin.replicas import Context

    monkeypatch.setattr(daso, "make_groups", lambda world, g: (None, [None] * g))  # no groups
    layout = types.SimpleNamespace(data_parallel=2, stages=1)
    world = types.SimpleNamespace(layout=layout, replica=0, dp_group=None, extra_groups=[])

    def replicas(**kw):
        spec = myelin.DASO(node_size=1, downcast="fp32", **kw)
        return daso.DasoReplicas(spec, Context(world, [torch.nn.Parameter(torch.zeros(3))]))

    for given in ({"epoch_steps": 6}, {}):  # set in DASO(...), or left to fit
        first = replicas(**given)
        first.plan(6, 10)
        saved = first.state_dict()
        again = replicas(**given)
        again.load_state_dict(saved)
        again.plan(6, 3)  # fit(epochs=3) to finish: the schedule's plan is the first run's
        sched = again._sched()
        assert (sched.last_batch + 1, sched.total_epochs) == (6, 10), given


def test_fit_epochs_count_in_dasos_own_epochs_when_it_sets_their_length(monkeypatch):
    """DASO(epoch_steps=4) under fit(epochs=10) over a loader of 6 batches: 60 steps are 15
    of DASO's epochs, so its cool-down comes at the end of the run, not after 40 steps."""
    import types

    import torch

    import myelin
    import myelin.replicas.daso as daso
    from myelin.replicas import Context

    monkeypatch.setattr(daso, "make_groups", lambda world, g: (None, [None] * g))
    layout = types.SimpleNamespace(data_parallel=2, stages=1)
    world = types.SimpleNamespace(layout=layout, replica=0, dp_group=None, extra_groups=[])
    params = [torch.nn.Parameter(torch.zeros(3))]
    for given, want in (({"epoch_steps": 4}, (4, 15)), ({}, (6, 10)),
                        ({"epoch_steps": 4, "total_epochs": 12}, (4, 12))):  # fmt: skip
        spec = myelin.DASO(node_size=1, downcast="fp32", **given)
        r = daso.DasoReplicas(spec, Context(world, params))
        r.plan(6, 10)
        sched = r._sched()
        assert (sched.last_batch + 1, sched.total_epochs) == want, given
