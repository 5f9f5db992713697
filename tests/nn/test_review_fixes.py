"""Fixes after a review of the SLIDE layer: a one-rank retry forgets what a failed step did
to an LSHSoftmax, LazyAdam's param groups refuse what its constructor refuses, make_xc's
oracle is at least the constant predictor and its extra labels have the mean asked for."""

from __future__ import annotations

import copy
import functools
import math
import pickle

import pytest
import torch
from torch import nn

import myelin
from myelin import ConfigError
from myelin.nn import LazyAdam, LSHSoftmax, XCConfig, make_xc, soft_target_loss
from myelin.nn.xc_data import MAX_EXTRA, _oracle_p1

IN, C = 32, 300


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # a probe every layer step with a threshold any change passes, and a redraw every 3:
    # the failed step below rebuilds and redraws the tables as well as drawing the floor
    head = LSHSoftmax(16, C, bits=4, tables=4, min_active=60, seed=3, check_every=1,
                      rebuild_threshold=1e-6, redraw_every=3)  # fmt: skip
    return nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), head)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, IN, generator=g), torch.randint(C, (8,), generator=g)) for _ in range(n)
    ]


def _trainer(fail: dict[str, bool]) -> tuple[myelin.Trainer, LSHSoftmax]:
    model = _model()
    head = model[2]
    calls = {"n": 0}

    def loss_fn(out, y):
        loss = head.loss(out, y)  # the layer's state has moved by now
        calls["n"] += 1
        if fail["now"] and calls["n"] % 2 == 0:  # the step's second microbatch
            raise ValueError("bad target")
        return loss

    opt = functools.partial(LazyAdam, lr=0.05)
    return myelin.Trainer(model, opt, loss_fn, microbatches=2), head


def _layer_state(head: LSHSoftmax) -> dict:
    return {
        "buffers": {k: v.clone() for k, v in head.state_dict().items()},  # rng_state synced
        "stats": dict(head.stats),
        "active": head.active.clone(),
    }


def test_a_retried_step_leaves_the_lsh_layer_as_if_it_had_never_failed():
    # retry put back running statistics and random streams but not the layer's step count,
    # moved marks, generators or (rebuilt, redrawn) tables: the run went on differently
    batches = _batches(4)
    ref, ref_head = _trainer({"now": False})
    with ref:
        want = [ref.step(x, y) for x, y in batches]
        want_state = _layer_state(ref_head)
        want_weights = ref.state_dict()
    fail = {"now": False}
    trainer, head = _trainer(fail)
    with trainer:
        got = [trainer.step(*batches[0])]
        before = _layer_state(head)
        fail["now"] = True
        with pytest.raises(ValueError, match="bad target"):
            trainer.step(*batches[1])
        assert int(head.steps) == 2 and head.stats == before["stats"]  # put back at once
        fail["now"] = False
        got += [trainer.step(x, y) for x, y in batches[1:]]
        state, weights = _layer_state(head), trainer.state_dict()
    assert int(ref_head.draws) == 2 and ref_head.stats["rebuilds"] > 2  # what was at stake
    assert got == want
    for k, v in want_weights.items():
        assert torch.equal(weights[k], v), k
    for k, v in want_state["buffers"].items():
        assert torch.equal(state["buffers"][k], v), k
    assert state["stats"] == want_state["stats"]
    assert torch.equal(state["active"], want_state["active"])


def test_a_layers_savepoint_copies_the_tables_only_when_a_rebuild_overwrites_them():
    head = _model()[2]
    h, y = torch.randn(8, 16), torch.arange(8)
    head.loss(h, y)  # step 1: a probe finds nothing moved, no rebuild
    saved = head.savepoint()
    assert saved.tables is None
    w0, moved = head.weight.detach().clone(), head.moved.clone()
    keys, projection = head.tables.keys.clone(), head.hasher.projection.clone()
    with torch.no_grad():
        head.weight.add_(1.0)  # codes change: the probe at step 2 rebuilds; step 3 redraws
    first = [head.loss(h, y).item() for _ in range(2)]
    assert saved.tables is not None and int(head.draws) == 1
    assert not torch.equal(head.tables.keys, keys)
    head.restore(saved)
    assert torch.equal(head.tables.keys, keys) and torch.equal(head.hasher.projection, projection)
    assert int(head.steps) == 1 and int(head.draws) == 0 and torch.equal(head.moved, moved)
    # the same two steps again draw the same floors and give the same losses
    assert [head.loss(h, y).item() for _ in range(2)] == first
    with torch.no_grad():
        head.weight.copy_(w0)
    head.restore(saved)
    del saved  # no savepoint alive: a rebuild copies nothing for one
    head.rebuild()
    with pytest.raises(ConfigError, match="another LSHSoftmax"):
        head.restore(_model()[2].savepoint())


def test_a_layer_holding_a_savepoint_pickles_and_copies_without_it():
    head = _model()[2]
    saved = head.savepoint()
    # our own bytes, not the network's: only that the weakref does not block pickling
    for copied in (pickle.loads(pickle.dumps(head)), copy.deepcopy(head)):  # noqa: S301
        assert copied._savepoint is None
        assert torch.equal(copied.tables.keys, head.tables.keys)
    assert head._savepoint() is saved  # the original still keeps its tables for it


def test_lsh_inference_of_the_wrong_width_names_the_width_it_takes():
    head = LSHSoftmax(16, C, bits=4, tables=4, min_active=60).eval()
    for mode in ("exact", "lsh"):
        with pytest.raises(ConfigError, match=r"input \(4, 9\) must be \(B, 16\)"):
            head(torch.randn(4, 9), inference=mode)
    with pytest.raises(ConfigError, match="in_features=16"):
        head.predict(torch.randn(16))


# -- LazyAdam ----------------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "name"), [({"weight_decay": 0.01}, "weight_decay"),
                                                ({"amsgrad": True}, "amsgrad"),
                                                ({"maximize": True}, "maximize")])  # fmt: skip
def test_a_param_group_refuses_what_the_constructor_refuses(setting, name):
    # add_param_group took weight_decay and amsgrad in a group and ignored them
    opt = LazyAdam([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match=f"{name}=.* is not supported"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], **setting})
    assert len(opt.param_groups) == 1  # the refused group was not added
    with pytest.raises(ConfigError, match=f"{name}=.* is not supported"):
        LazyAdam([{"params": [nn.Parameter(torch.zeros(2))], **setting}], lr=0.1)


def test_maximize_is_a_config_error_naming_it_not_a_type_error():
    with pytest.raises(ConfigError, match="maximize=True is not supported"):
        LazyAdam([nn.Parameter(torch.zeros(2))], maximize=True)
    LazyAdam([nn.Parameter(torch.zeros(2))], maximize=False)  # torch's default


def test_lr_zero_is_allowed_as_torch_allows_it_and_moves_nothing():
    p, q = nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(3, 2))
    w0 = p.detach().clone()
    lazy = LazyAdam([p], lr=0.0)
    LazyAdam([q], lr=0.1).add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0})
    torch.optim.Adam([q], lr=0.0)  # torch's Adam allows it too
    p.grad = torch.ones_like(p)
    lazy.step()
    assert torch.equal(p.detach(), w0)
    assert lazy.state[p]["step"].tolist() == [1, 1, 1]
    with pytest.raises(ConfigError, match=r"lr=-0\.1 must be a number >= 0"):
        LazyAdam([p], lr=-0.1)


# -- make_xc -----------------------------------------------------------------------------


def _prior_p1(data, rows: int = 1000) -> float:
    """P@1 of always predicting the most frequent label, on the rows the oracle scores."""
    top = int(data.prior.argmax())
    n = min(rows, len(data.test))
    b = data.test.batch(torch.arange(n))
    return float((b.labels == top).any(1).float().mean())


def test_the_oracle_is_never_below_the_constant_predictor():
    # steep prior, labels with one feature kept rarely, many noise features: the prototype
    # scorer fell to 0.45 where always answering the top label scored 0.92
    cfg = XCConfig(num_labels=2000, num_features=500, train_rows=10, test_rows=1000, topics=50,
                   alpha=4.0, own_features=1, topic_features=0, keep=0.1, noise=30)  # fmt: skip
    data = make_xc(cfg, seed=0)
    prior = _prior_p1(data)
    assert prior > 0.8
    assert data.ceilings["oracle_p1"] >= prior
    assert data.ceilings["prior_p1"] == pytest.approx(prior)


def test_the_default_oracle_is_the_prototype_scorers():
    cfg = XCConfig(train_rows=10, test_rows=1000)
    data = make_xc(cfg, seed=0)
    scorer = _oracle_p1(data.test, data.prototypes, data.prior, cfg.num_features)
    assert data.ceilings["oracle_p1"] == scorer > 0.9  # far above the constant predictor
    assert data.ceilings["prior_p1"] == pytest.approx(_prior_p1(data))
    assert data.ceilings["prior_p1"] < 0.2


def test_extra_labels_are_drawn_without_repeats_so_their_mean_is_what_was_asked():
    # drawn with replacement within a topic of ~25 labels and deduplicated, 4 extra labels
    # a row came out as about 3.5
    cfg = XCConfig(num_labels=2000, num_features=300, train_rows=8000, test_rows=10, topics=80,
                   extra_labels=4.0)  # fmt: skip
    data = make_xc(cfg, seed=0)
    sizes = torch.bincount(data.topic, minlength=cfg.topics)
    assert int(sizes.min()) > MAX_EXTRA  # no topic too small to hold a row's extra labels
    per_row = data.train.label_rows.diff()
    want = _capped_mean(cfg.extra_labels, MAX_EXTRA)
    sd = 2.0 / math.sqrt(len(per_row))  # Poisson(4) sd / sqrt(rows)
    assert float(per_row.float().mean()) - 1 == pytest.approx(want, abs=4 * sd)
    for i in range(200):  # every row: distinct labels, all of its primary's topic
        row = data.train.labels[data.train.label_rows[i] : data.train.label_rows[i + 1]]
        assert row.unique().numel() == row.numel()
        assert (data.topic[row] == data.topic[row[0]]).all()


def _capped_mean(lam: float, cap: int) -> float:
    """The mean of min(Poisson(lam), cap)."""
    p = [math.exp(-lam) * lam**k / math.factorial(k) for k in range(cap)]
    return sum(k * pk for k, pk in enumerate(p)) + cap * (1 - sum(p))


def test_a_topic_smaller_than_the_extra_labels_asked_gives_each_of_its_labels_once():
    # topics of ~2 labels: with replacement and deduplicated, a row drew its one topic mate
    # again and again and often ended up without it
    cfg = XCConfig(num_labels=40, num_features=100, train_rows=4000, test_rows=10, topics=20,
                   extra_labels=4.0)  # fmt: skip
    data = make_xc(cfg, seed=1)
    sizes = torch.bincount(data.topic, minlength=cfg.topics)
    starts, ends = data.train.label_rows[:-1], data.train.label_rows[1:]
    mates = sizes[data.topic[data.train.labels[starts]]] - 1  # the other labels of the topic
    want = sum(_capped_mean(4.0, min(MAX_EXTRA, int(m))) for m in mates) / len(mates)
    assert float((ends - starts - 1).float().mean()) == pytest.approx(want, abs=0.05)
    for i in range(len(data.train)):
        row = data.train.labels[starts[i] : ends[i]]
        assert row.unique().numel() == row.numel() <= int(mates[i]) + 1


def _head(**settings) -> LSHSoftmax:
    torch.manual_seed(0)
    return LSHSoftmax(16, 50, bits=4, tables=4, min_active=10, seed=3, **settings)


def test_eval_with_labels_is_the_exact_loss_and_lsh_logits_are_refused_by_the_loss():
    head = _head()
    h, y = torch.randn(6, 16), torch.randint(50, (6,))
    dense = h @ head.weight.detach().t() + head.bias.detach()
    head.eval()
    assert torch.allclose(head(h, y), soft_target_loss(dense, y))  # as training's call: a loss
    lsh = _head(inference="lsh").eval()
    logits = lsh(h)
    missed = torch.isneginf(logits.gather(1, y[:, None])).any()
    assert missed  # the tables of 4 bits x 4 miss some label at this size
    exact = h @ lsh.weight.detach().t() + lsh.bias.detach()
    # the layer's own latest LSH logits (a Trainer's eval_step): the loss is the exact one
    assert torch.allclose(lsh.loss(logits, y), soft_target_loss(exact, y))
    with pytest.raises(ConfigError, match="inference='exact'"):
        lsh.loss(logits.clone(), y)  # LSH-only logits it cannot trace back to their h
    assert torch.isfinite(lsh(h, y))  # eval with labels: exact logits, whatever `inference`


def test_edges_of_the_loss_and_predict_are_named_not_nan_or_torch_errors():
    head = _head()
    empty = head.loss(torch.randn(0, 16), torch.zeros(0, dtype=torch.long))
    assert empty.item() == 0.0
    empty.backward()  # a gradient of zeros, not nan
    with pytest.raises(ConfigError, match=r"k=51 must be an int in \[1, 50\]"):
        head.predict(torch.randn(2, 16), 51)
    logits = torch.randn(3, 5)
    one = soft_target_loss(logits, torch.tensor([1, 4, 0]))
    assert torch.equal(one, soft_target_loss(logits, torch.tensor([[1], [4], [0]])))
    twice = soft_target_loss(logits, torch.tensor([[1, 1], [4, -1], [0, 0]]))
    assert torch.equal(twice, one)  # a label repeated in a row counts once
    with pytest.raises(ConfigError, match="num_classes=5"):
        soft_target_loss(logits, torch.tensor([1, 5, 0]))
    with pytest.raises(ConfigError, match="-1 pads a row"):
        soft_target_loss(logits, torch.tensor([1, -3, 0]))


def test_exact_eval_logits_have_the_gradient_of_a_dense_layer():
    head = _head().eval()
    dense = nn.Linear(16, 50)
    dense.load_state_dict({"weight": head.weight.detach(), "bias": head.bias.detach()})
    h, y = torch.randn(4, 16), torch.randint(50, (4,))
    torch.nn.functional.cross_entropy(head(h), y).backward()
    torch.nn.functional.cross_entropy(dense(h), y).backward()
    assert torch.equal(head.weight.grad, dense.weight.grad)
    assert not _head(inference="lsh").eval()(h).requires_grad
