"""Synthetic extreme-classification data: sparse features, power-law labels, a stated ceiling.

    data = make_xc(XCConfig(num_labels=20_000, num_features=5_000, train_rows=20_000), seed=0)
    for batch in data.train.batches(128, seed=epoch):   # XCBatch: bag of features, labels
        ...
    data.ceilings   # {"seen_label": share of test rows with a label seen in training,
                    #  "oracle_p1": P@1 of the better of a scorer that knows the prototypes
                    #  and the constant predictor, "prior_p1": the constant predictor's}

Nothing is downloaded and everything is a function of the seed. Labels get a power-law
prior over a random ranking (ids are not sorted by frequency) and fall into topics; each
label owns a few prototype features, some shared within its topic, some its own. A row
draws a primary label from the prior plus a few correlated labels of the same topic, keeps
each of their prototype features with probability `keep`, adds `noise` random features,
and is L2-normalised (the recipe of shared/algorithms/slide.md section 4).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from myelin.errors import ConfigError

__all__ = ["MAX_EXTRA", "XCBatch", "XCConfig", "XCData", "XCSplit", "make_xc"]

MAX_EXTRA = 8  # most extra labels a row gets


@dataclass(frozen=True, kw_only=True, slots=True)
class XCConfig:
    """The shape of a synthetic extreme-classification set; checked when built.

    num_labels, num_features: label and feature vocabularies.
    train_rows, test_rows: rows in each split.
    topics: label groups; labels of one topic share features and co-occur.
    alpha: exponent of the power-law label prior (p ~ rank^-alpha).
    own_features, topic_features: prototype features a label owns / takes from its topic.
    topic_pool: features each topic offers its labels.
    extra_labels: mean number of extra labels per row (Poisson, at most MAX_EXTRA a row),
        distinct labels of the primary's topic (at most all of its other labels); up to
        MAX_EXTRA / 2, where the cap barely moves the mean.
    keep: probability each prototype feature of a row's label appears in the row.
    noise: random features added to each row.
    """

    num_labels: int = 20_000
    num_features: int = 5_000
    train_rows: int = 20_000
    test_rows: int = 5_000
    topics: int = 500
    alpha: float = 1.0
    own_features: int = 3
    topic_features: int = 2
    topic_pool: int = 12
    extra_labels: float = 0.5
    keep: float = 0.6
    noise: int = 4

    def __post_init__(self) -> None:
        for name in ("num_labels", "num_features", "train_rows", "test_rows", "topics"):
            _check_int(name, getattr(self, name), 1)
        for name in ("own_features", "topic_features", "noise"):
            _check_int(name, getattr(self, name), 0)
        _check_int("topic_pool", self.topic_pool, max(1, self.topic_features))
        if self.topics > self.num_labels:
            raise ConfigError(f"topics={self.topics} must be <= num_labels={self.num_labels}")
        if self.own_features + self.topic_features == 0:
            raise ConfigError("own_features + topic_features must be >= 1: labels need features")
        _check_number("keep", self.keep, 0, 1, low_open=True)
        _check_number("alpha", self.alpha, 0, 4)
        _check_number("extra_labels", self.extra_labels, 0, MAX_EXTRA / 2)


@dataclass(frozen=True, slots=True)
class XCBatch:
    """One batch: a bag of features per row and its labels, padded with -1.

    features, weights: (nnz,) feature ids and values; offsets: (B,) start of each row in
    them (the layout of nn.EmbeddingBag). labels: (B, M) int64, -1 where a row has fewer.
    """

    features: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass(frozen=True, slots=True)
class XCSplit:
    """Rows in CSR form: row i's features are features[rows[i]:rows[i+1]], its labels
    labels[label_rows[i]:label_rows[i+1]]."""

    features: torch.Tensor
    weights: torch.Tensor
    rows: torch.Tensor
    labels: torch.Tensor
    label_rows: torch.Tensor

    def __len__(self) -> int:
        return self.rows.numel() - 1

    def batch(self, index: torch.Tensor) -> XCBatch:
        """The rows `index` as one batch."""
        starts, ends = self.rows[index], self.rows[index + 1]
        lengths = ends - starts
        feats = _ranges(starts, lengths)
        offsets = torch.cumsum(lengths, 0) - lengths
        lstarts, lends = self.label_rows[index], self.label_rows[index + 1]
        llen = lends - lstarts
        width = int(llen.max()) if len(index) else 1
        col = torch.arange(width).expand(len(index), width)
        valid = col < llen[:, None]
        pos = (lstarts[:, None] + col).clamp(max=max(self.labels.numel() - 1, 0))
        labels = torch.where(valid, self.labels[pos], torch.full_like(pos, -1))
        return XCBatch(self.features[feats], self.weights[feats], offsets, labels)

    def batches(self, batch_size: int, seed: int | None = None) -> Iterator[XCBatch]:
        """Batches in order (seed None) or shuffled by `seed`; the last may be smaller."""
        _check_int("batch_size", batch_size, 1)
        if seed is not None:
            _check_int("seed", seed, 0)
        n = len(self)
        order = (
            torch.arange(n)
            if seed is None
            else torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        )
        for start in range(0, n, batch_size):
            yield self.batch(order[start : start + batch_size])


@dataclass(frozen=True, slots=True)
class XCData:
    """Both splits, the config and seed they came from, and the ceilings."""

    config: XCConfig
    seed: int
    train: XCSplit
    test: XCSplit
    prototypes: torch.Tensor  # (num_labels, P) feature ids of each label's prototype, -1 pad
    prior: torch.Tensor  # (num_labels,) label probabilities
    topic: torch.Tensor  # (num_labels,) each label's topic
    ceilings: dict[str, float]


def make_xc(config: XCConfig, seed: int = 0) -> XCData:
    """A synthetic extreme-classification set, the same for the same config and seed."""
    if not isinstance(config, XCConfig):
        raise ConfigError(f"make_xc(config={config!r}) must be a myelin.nn.XCConfig")
    _check_int("seed", seed, 0)
    cfg = config
    g = torch.Generator().manual_seed(seed)
    rank = torch.randperm(cfg.num_labels, generator=g)  # label id -> its frequency rank
    prior = (rank.double() + 1).pow(-cfg.alpha)
    prior = (prior / prior.sum()).float()
    topic = torch.randint(cfg.topics, (cfg.num_labels,), generator=g)
    pools = torch.randint(cfg.num_features, (cfg.topics, cfg.topic_pool), generator=g)
    pick = torch.rand(cfg.num_labels, cfg.topic_pool, generator=g).argsort(1)
    shared = pools[topic].gather(1, pick[:, : cfg.topic_features])
    own = torch.randint(cfg.num_features, (cfg.num_labels, cfg.own_features), generator=g)
    prototypes = torch.cat([shared, own], 1)
    members = torch.argsort(topic, stable=True)  # labels grouped by topic
    sizes = torch.bincount(topic, minlength=cfg.topics)
    starts = torch.cumsum(sizes, 0) - sizes
    split = (members, starts, sizes, topic)
    train = _rows(cfg, g, prior, prototypes, split, cfg.train_rows)
    test = _rows(cfg, g, prior, prototypes, split, cfg.test_rows)
    # the prototype scorer breaks ties by the prior but weighs it at 1e-3 of a feature: at
    # a steep prior with few kept features it falls below always answering the top label
    prior_p1 = _prior_p1(test, prior)
    ceilings = {
        "seen_label": _seen_share(train, test, cfg.num_labels),
        "oracle_p1": max(_oracle_p1(test, prototypes, prior, cfg.num_features), prior_p1),
        "prior_p1": prior_p1,
    }
    return XCData(cfg, seed, train, test, prototypes, prior, topic, ceilings)


def _rows(cfg: XCConfig, g: torch.Generator, prior, prototypes, split, n: int) -> XCSplit:
    members, starts, sizes, topic = split
    primary = torch.multinomial(prior, n, replacement=True, generator=g)
    extra = torch.poisson(torch.full((n,), cfg.extra_labels), generator=g).long()
    extra = extra.clamp(max=MAX_EXTRA)
    width = int(extra.max()) + 1 if n else 1
    t = topic[primary]
    # the extra labels: distinct, drawn without replacement from the primary's topic, so
    # a row gets as many as drawn (a topic with fewer other labels gives each of them once)
    size = sizes[t]
    extra = torch.minimum(extra, size - 1)
    u = torch.rand(n, width - 1, generator=g).double()  # as many draws as before
    place = torch.empty(cfg.num_labels, dtype=torch.long)  # a label's place in its topic
    place[members] = torch.arange(cfg.num_labels) - starts[topic[members]]
    taken = torch.empty(n, width, dtype=torch.long)
    taken[:, 0] = place[primary]
    for j in range(1, width):  # the j-th of the free places: uniform among those left
        free = (size - j).clamp(min=1)
        r = (u[:, j - 1] * free).long().clamp(max=free - 1)
        for e in taken[:, :j].sort(1).values.unbind(1):  # skip the taken ones, in order
            r += e <= r
        taken[:, j] = r.clamp(max=size - 1)  # a column past the topic's labels: unused
    labels = members[starts[t, None] + taken]  # (n, width), the primary first
    valid = torch.arange(width)[None, :] <= extra[:, None]
    # features: each kept prototype feature of each label, plus noise
    proto = prototypes[labels]  # (n, width, P)
    keep = (torch.rand(proto.shape, generator=g) < cfg.keep) & valid[:, :, None]
    keep[:, 0, 0] = True  # every row shows at least one feature of its primary label
    noise = torch.randint(cfg.num_features, (n, cfg.noise), generator=g)
    feats = torch.cat([proto.reshape(n, -1), noise], 1)
    fkeep = torch.cat([keep.reshape(n, -1), torch.ones(n, cfg.noise, dtype=torch.bool)], 1)
    counts = fkeep.sum(1)
    # A feature can repeat in a row (labels of a topic share features; noise may repeat
    # one), and repeats add up: the row's norm is sqrt(sum of its features' multiplicity
    # squared), so each entry is weighted by one over that, for a norm of exactly 1.
    row_of = torch.arange(n)[:, None].expand_as(feats)[fkeep]
    _, where, mult = torch.unique(row_of * cfg.num_features + feats[fkeep], return_inverse=True,
                                  return_counts=True)  # fmt: skip
    sq = torch.zeros(n).index_add_(0, row_of, mult[where].float())  # sum of mult^2 per row
    weights = torch.zeros(feats.shape)
    weights[fkeep] = torch.rsqrt(sq)[row_of]
    rows = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    lcounts = valid.sum(1)
    label_rows = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lcounts, 0)])
    return XCSplit(feats[fkeep], weights[fkeep].contiguous(), rows, labels[valid], label_rows)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total) - torch.repeat_interleave(first - starts, lengths)


def _seen_share(train: XCSplit, test: XCSplit, num_labels: int) -> float:
    """Share of test rows with at least one label that occurs in training."""
    seen = torch.zeros(num_labels, dtype=torch.bool)
    seen[train.labels] = True
    row = torch.repeat_interleave(torch.arange(len(test)), test.label_rows.diff())
    hit = torch.zeros(len(test), dtype=torch.bool)
    hit[row[seen[test.labels]]] = True
    return float(hit.float().mean())


def _prior_p1(test: XCSplit, prior, rows: int = 1000) -> float:
    """P@1 of the constant predictor, always the most frequent label, on the rows that
    `_oracle_p1` scores: the floor any ceiling is at least."""
    n = min(rows, len(test))
    if n == 0:
        return 0.0
    labels = test.batch(torch.arange(n)).labels
    return float((labels == int(prior.argmax())).any(1).float().mean())


def _oracle_p1(test: XCSplit, prototypes, prior, num_features: int, rows: int = 1000) -> float:
    """P@1 of the scorer that counts a row's features in each label's prototype (weighted)
    and breaks ties by the prior: what a model could reach knowing how rows are made,
    where the features, not the prior, decide (make_xc reports the better of it and the
    constant predictor; neither is a proof that no model scores higher)."""
    num_labels, width = prototypes.shape
    label_of = torch.arange(num_labels).repeat_interleave(width)
    flat = prototypes.reshape(-1)
    proto = torch.sparse_coo_tensor(
        torch.stack([label_of, flat]),
        torch.ones(flat.numel()),
        (num_labels, num_features),
        check_invariants=True,
    ).coalesce()
    tie = (prior / prior.max() * 1e-3)[:, None]
    hits, n = 0, min(rows, len(test))
    for start in range(0, n, 250):
        idx = torch.arange(start, min(start + 250, n))
        b = test.batch(idx)
        ends = torch.cat([b.offsets[1:], torch.tensor([b.features.numel()])])
        row = torch.repeat_interleave(torch.arange(len(idx)), ends - b.offsets)
        x = torch.zeros(num_features, len(idx))
        x.index_put_((b.features, row), b.weights, accumulate=True)
        scores = torch.sparse.mm(proto, x) + tie  # (num_labels, rows)
        best = scores.argmax(0)
        hits += int((b.labels == best[:, None]).any(1).sum())
    return hits / max(n, 1)


def _check_number(name: str, value: object, low: float, high: float, low_open=False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (low < value if low_open else low <= value) or not value <= high:
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise ConfigError(f"{name}={value!r} must be a number in {bounds}")


def _check_int(name: str, value: object, low: int) -> None:
    if type(value) is not int or value < low:
        raise ConfigError(f"{name}={value!r} must be an int >= {low}")
