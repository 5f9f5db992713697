"""The synthetic extreme-classification generator: deterministic, power-law, correlated."""

from __future__ import annotations

import pytest
import torch

from myelin import ConfigError
from myelin.nn import XCConfig, make_xc

SMALL = XCConfig(num_labels=2_000, num_features=1_000, train_rows=3_000, test_rows=500, topics=50)


def test_the_same_seed_gives_the_same_data_and_another_seed_other_data():
    a, b, c = make_xc(SMALL, seed=1), make_xc(SMALL, seed=1), make_xc(SMALL, seed=2)
    for name in ("features", "weights", "rows", "labels", "label_rows"):
        assert torch.equal(getattr(a.train, name), getattr(b.train, name))
    assert a.ceilings == b.ceilings
    assert not torch.equal(a.train.labels[:100], c.train.labels[:100])


def test_labels_follow_a_power_law_over_unsorted_ids_and_co_occur_within_topics():
    data = make_xc(SMALL, seed=0)
    counts = torch.bincount(data.train.labels, minlength=SMALL.num_labels).float()
    top = counts.sort(descending=True).values
    assert top[0] > 20 * top[200].clamp(min=1)  # a head and a long tail
    assert int(counts.argmax()) != 0  # ids are not sorted by frequency
    # rows with several labels: their labels share a topic, and so prototype features
    rows = data.train.label_rows
    multi = rows.diff() > 1
    assert multi.float().mean() > 0.2
    start = rows[:-1][multi]
    first, second = data.train.labels[start], data.train.labels[start + 1]
    assert torch.equal(data.topic[first], data.topic[second])
    proto = data.prototypes
    share = (proto[first][:, :, None] == proto[second][:, None, :]).any(2).any(1)
    other = second.roll(1)  # the same labels, paired at random
    chance = (proto[first][:, :, None] == proto[other][:, None, :]).any(2).any(1)
    assert share.float().mean() > 5 * chance.float().mean()


def _dense(b, width):
    """The batch's rows as dense vectors, a repeated feature's values added up (as the
    example's `index_put_(..., accumulate=True)` does)."""
    ends = torch.cat([b.offsets[1:], torch.tensor([b.features.numel()])])
    row = torch.repeat_interleave(torch.arange(len(b.offsets)), ends - b.offsets)
    x = torch.zeros(len(b.offsets), width)
    return x.index_put_((row, b.features), b.weights, accumulate=True)


def test_rows_with_a_repeated_feature_are_normalised_once_it_is_added_up():
    data = make_xc(SMALL, seed=0)
    b = next(data.train.batches(data.train.rows.numel() - 1, seed=0))
    x = _dense(b, SMALL.num_features)
    ends = torch.cat([b.offsets[1:], torch.tensor([b.features.numel()])])
    repeats = (x != 0).sum(1) < ends - b.offsets  # fewer distinct features than entries
    assert repeats.any(), "no row repeats a feature: the check below tests nothing"
    assert torch.allclose(x.norm(dim=1), torch.ones(len(x)), atol=1e-5)


def test_batches_are_sparse_bags_normalised_with_padded_labels():
    data = make_xc(SMALL, seed=0)
    b = next(data.train.batches(16, seed=3))
    assert b.labels.shape[0] == 16 and (b.labels[:, 0] >= 0).all()
    assert torch.allclose(_dense(b, SMALL.num_features).norm(dim=1), torch.ones(16), atol=1e-5)
    assert 0.5 < data.ceilings["seen_label"] <= 1 and 0.5 < data.ceilings["oracle_p1"] <= 1
    assert sum(len(x) for x in data.test.batches(128)) == 500


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"num_labels": 0}, "num_labels"),
        ({"num_labels": 10, "topics": 50}, "topics"),
        ({"keep": 0.0}, "keep"),
        ({"alpha": -1.0}, "alpha"),
        ({"own_features": 0, "topic_features": 0}, "own_features"),
        ({"keep": "0.5"}, "keep"),
        ({"alpha": None}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"extra_labels": "1"}, "extra_labels"),
        ({"extra_labels": 16}, "extra_labels"),  # past what the per-row cap allows
    ],
)
def test_bad_shapes_are_rejected_naming_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        XCConfig(**kw)


def test_bad_seeds_and_batch_sizes_are_rejected_naming_the_field():
    cfg = XCConfig(num_labels=50, num_features=40, train_rows=30, test_rows=10, topics=5)
    with pytest.raises(ConfigError, match="seed=1.5"):
        make_xc(cfg, seed=1.5)
    with pytest.raises(ConfigError, match="config"):
        make_xc({"num_labels": 50})
    data = make_xc(cfg)
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=f"batch_size={bad}"):
            next(data.test.batches(bad))


def test_the_mean_of_extra_labels_is_what_was_asked():
    cfg = XCConfig(num_labels=4000, num_features=300, train_rows=4000, test_rows=10, topics=20,
                   extra_labels=4.0)  # fmt: skip
    data = make_xc(cfg, seed=0)
    per_row = (data.train.label_rows[1:] - data.train.label_rows[:-1]).float()
    # the primary and 4 on average (a few fewer: capped at 8, repeats within a topic dropped)
    assert per_row.mean() == pytest.approx(5.0, abs=0.2)
