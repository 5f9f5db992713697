"""LSHSoftmax against dense PyTorch: gradients, retrieval, inference, rebuilds, checkpoints."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from myelin import ConfigError
from myelin.nn import LazyAdam, LSHConfig, LSHSoftmax, soft_target_loss

H, C = 16, 300


def _labels(b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(C, (b, 3), generator=g)
    labels[0, 1:] = -1  # rows with 1, 2 and 3 labels
    labels[1, 2] = -1
    return labels


def test_active_set_gradients_equal_autograd_on_the_dense_layer_restricted_to_it():
    torch.manual_seed(0)
    head = LSHSoftmax(H, C, bits=4, tables=3, min_active=40)
    h = torch.relu(torch.randn(6, H)).requires_grad_(True)
    labels = _labels(6)
    loss = head(h, labels)
    loss.backward()
    active = head.active
    assert 40 <= active.numel() < C  # the set is a real subset here

    w = head.weight.detach().clone().requires_grad_(True)
    b = head.bias.detach().clone().requires_grad_(True)
    h2 = h.detach().clone().requires_grad_(True)
    logits = (h2 @ w.t() + b)[:, active]
    pos = torch.searchsorted(active, labels.clamp(min=0))
    ref = soft_target_loss(logits, torch.where(labels >= 0, pos, labels))
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-6)
    assert head.weight.grad.is_sparse and head.bias.grad.is_sparse
    gw = head.weight.grad.to_dense()
    assert torch.allclose(gw, w.grad, atol=1e-6)
    assert torch.allclose(head.bias.grad.to_dense(), b.grad, atol=1e-6)
    assert torch.allclose(h.grad, h2.grad, atol=1e-6)
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[active] = False
    assert gw[untouched].abs().sum() == 0
    # by hand, SLIDE's delta: the bias gradient is (p - 1/|Y| on labels) / B over the batch
    delta = (torch.softmax(logits.detach(), 1) - _soft(labels, pos, active.numel())) / 6
    assert torch.allclose(head.bias.grad.to_dense()[active], delta.sum(0), atol=1e-6)


def _soft(labels: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(labels.shape[0], width)
    for i in range(labels.shape[0]):
        mine = pos[i][labels[i] >= 0]
        out[i, mine] += 1 / len(mine)
    return out


def test_lazy_adam_equals_dense_adam_on_each_row_it_touched():
    torch.manual_seed(1)
    w0 = torch.randn(20, 5)
    lazy = nn.Parameter(w0.clone())
    opt = LazyAdam([lazy], lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    rows_ref = [nn.Parameter(w0[r].clone()) for r in range(20)]
    ref = [torch.optim.Adam([p], lr=0.05, betas=(0.8, 0.95), eps=1e-6) for p in rows_ref]
    for step in range(6):
        rows = torch.randperm(20)[: 4 + step].sort().values  # a different set each step
        grad = torch.randn(rows.numel(), 5)
        lazy.grad = torch.sparse_coo_tensor(rows[None], grad, (20, 5), check_invariants=True)
        opt.step()
        for r, g in zip(rows.tolist(), grad, strict=True):
            rows_ref[r].grad = g.clone()
            ref[r].step()
    expected = torch.stack([p.detach() for p in rows_ref])
    assert torch.allclose(lazy.detach(), expected, atol=1e-6)
    never = [r for r in range(20) if not ref[r].state]
    for r in never:
        assert torch.equal(lazy.detach()[r], w0[r])  # untouched rows did not move at all
    # a dense gradient is every row touched: equal to torch's Adam
    dense, dense_ref = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    o1, o2 = LazyAdam([dense], lr=0.01), torch.optim.Adam([dense_ref], lr=0.01)
    for _ in range(3):
        g = torch.randn(20, 5)
        dense.grad, dense_ref.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.allclose(dense.detach(), dense_ref.detach(), atol=1e-6)


@pytest.mark.parametrize("family", ["simhash", "dwta"])
def test_a_class_whose_weight_equals_the_query_is_retrieved_by_every_table(family):
    torch.manual_seed(2)
    head = LSHSoftmax(H, C, family=family, bits=5, tables=4, bucket_cap=C, min_active=0, min_hits=4)
    queries = torch.relu(torch.randn(5, H))
    targets = torch.tensor([3, 77, 150, 151, 299])
    with torch.no_grad():
        head.weight[targets] = queries
    head.rebuild()
    ids, row = head.tables.query(head.hasher(queries))
    for i, t in enumerate(targets.tolist()):
        assert int(((ids == t) & (row == i)).sum()) == head.config.tables
    # and it is in the active set without being a label, with no floor, when every table
    # must return a class (min_hits=tables)
    head(queries, torch.full((5, 1), -1)).backward()
    assert set(targets.tolist()) <= set(head.active.tolist())
    assert head.active.numel() < C


def test_labels_are_always_active_even_past_max_active():
    head = LSHSoftmax(H, C, bits=2, tables=4, min_active=0, max_active=5)
    h = torch.relu(torch.randn(8, H))
    labels = _labels(8, seed=3)
    head(h, labels).backward()
    active = set(head.active.tolist())
    assert set(labels[labels >= 0].tolist()) <= active
    assert len(active) <= 5 + int((labels >= 0).sum())
    # the set's make-up: its labels, retrieved classes that are not labels, no floor
    stats, n_labels = head.stats, len(set(labels[labels >= 0].tolist()))
    assert (stats["last_labels"], stats["last_floor"]) == (n_labels, 0)
    assert stats["last_retrieved"] == len(active) - n_labels == 5
    # with a floor of 100: the rest are random classes
    head = LSHSoftmax(H, C, bits=8, tables=1, min_active=100)
    head(h, labels).backward()
    stats = head.stats
    ids, _ = head.tables.query(head.hasher(h))
    found = set(ids.tolist()) - set(labels[labels >= 0].tolist())
    assert (stats["last_labels"], stats["last_retrieved"]) == (n_labels, len(found))
    assert stats["last_floor"] == 100 - n_labels - len(found) > 0


def test_exact_inference_equals_a_dense_layer_and_lsh_inference_is_its_restriction():
    head = LSHSoftmax(H, C, bits=4, tables=3)
    dense = nn.Linear(H, C)
    dense.load_state_dict({"weight": head.weight.detach(), "bias": head.bias.detach()})
    h = torch.randn(7, H)
    head.eval()
    assert torch.equal(head(h), dense(h).detach())
    lsh = head(h, inference="lsh")
    ids, row = head.tables.query(head.hasher(h))
    finite = torch.isfinite(lsh)
    assert finite.sum() == len(set(zip(row.tolist(), ids.tolist(), strict=True)))
    assert torch.allclose(lsh[finite], dense(h).detach()[finite], atol=1e-5)
    assert head.predict(h).shape == (7, 1)
    # in eval mode, loss() is the exact soft-target loss of the logits
    labels = _labels(7)
    assert torch.allclose(head.loss(head(h), labels), soft_target_loss(dense(h), labels))


def test_rebuild_follows_weight_movement_not_the_clock():
    head = LSHSoftmax(H, C, bits=6, tables=4, check_every=1, rebuild_threshold=0.05)
    h, labels = torch.relu(torch.randn(4, H)), _labels(4)
    for _ in range(10):  # the weights do not move: probes, no rebuild
        head(h, labels)
    # the build at construction is not a rebuild (the example printed "rebuilds 1" for none)
    assert head.stats["checks"] == 10 and head.stats["rebuilds"] == 0
    with torch.no_grad():
        head.weight.add_(torch.randn_like(head.weight))
    head(h, labels)
    assert head.stats["rebuilds"] == 1 and head.stats["last_change"] > 0.05
    assert torch.equal(head.tables.codes, head.hasher(head.weight))


def test_rows_that_training_moved_stay_retrievable_for_their_queries():
    # a planted problem: of 20,000 classes only the 20 active ones move (onto their rows'
    # queries), as a lazy optimizer moves only active rows. The probe must look at them:
    # a probe of random classes of all C (2048 of 20,000) sees about 2 of the 20, measures
    # almost no change, never rebuilds, and the tables keep missing the moved classes.
    wide = 20_000
    head = LSHSoftmax(
        H, wide, bits=6, tables=4, bucket_cap=wide, min_hits=4, min_active=0, check_every=1
    )
    g = torch.Generator().manual_seed(5)
    queries = torch.relu(torch.randn(20, H, generator=g))
    labels = torch.arange(20)[:, None] * 997
    head(queries, labels)  # the labels are active: trained this step
    with torch.no_grad():
        head.weight[labels[:, 0]] = queries  # ... and move onto their queries
    head(queries, labels)  # the next step's probe sees them
    assert head.stats["rebuilds"] == 1 and head.stats["last_change"] > 0.5
    ids, row = head.tables.query(head.hasher(queries))
    found = [bool(((ids == int(t)) & (row == i)).any()) for i, t in enumerate(labels[:, 0])]
    assert all(found)
    # a build starts the watch anew: only the step after it counts as moved
    assert torch.equal(head.moved.nonzero().squeeze(1), head.active)


def _train(head: LSHSoftmax, opt: LazyAdam, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        h = torch.relu(torch.randn(8, H, generator=g))
        labels = torch.randint(C, (8, 2), generator=g)
        opt.zero_grad()
        head(h, labels).backward()
        opt.step()


def _saved(head: LSHSoftmax, opt: LazyAdam) -> bytes:
    buf = io.BytesIO()
    torch.save({"layer": head.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def _restore(saved: bytes, head: LSHSoftmax, opt: LazyAdam) -> None:
    state = torch.load(io.BytesIO(saved), weights_only=False)
    head.load_state_dict(state["layer"])
    opt.load_state_dict(state["opt"])


def test_checkpoint_resume_restores_layer_optimizer_state_and_tables():
    def fresh() -> tuple[LSHSoftmax, LazyAdam]:
        head = LSHSoftmax(H, C, bits=3, tables=4, check_every=2, rebuild_threshold=0.01)
        return head, LazyAdam(head.parameters(), lr=0.05)

    head, opt = fresh()
    _train(head, opt, 6, seed=0)
    saved = _saved(head, opt)
    _train(head, opt, 6, seed=1)
    assert head.stats["rebuilds"] > 1  # tables were rebuilt along the way

    other, other_opt = fresh()
    _train(other, other_opt, 1, seed=5)  # different state before loading
    _restore(saved, other, other_opt)
    _train(other, other_opt, 6, seed=1)
    for name, value in head.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other.state_dict()[name]), name
    assert torch.equal(head.active, other.active)
    assert int(head.steps) == int(other.steps) == 12


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"bits": 0}, "bits"),
        ({"bits": 31}, "bits"),
        ({"tables": 0}, "tables"),
        ({"family": "minhash"}, "family"),
        ({"family": "dwta", "bits": 11, "bin_size": 8}, "bits"),
        ({"family": "dwta", "bin_size": 32}, "bin_size"),
        ({"bucket_cap": 0}, "bucket_cap"),
        ({"min_active": -1}, "min_active"),
        ({"max_active": 0}, "max_active"),
        ({"min_hits": 17, "tables": 16}, "min_hits"),
        ({"rebuild_threshold": 0.0}, "rebuild_threshold"),
        ({"check_every": 0}, "check_every"),
        ({"redraw_every": 0}, "redraw_every"),
        ({"inference": "approx"}, "inference"),
        ({"tables": 2.5}, "tables"),
        ({"tabels": 4}, "tabels"),
    ],
)
def test_bad_settings_are_rejected_naming_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        LSHSoftmax(H, C, **settings)


def test_bad_sizes_and_labels_are_rejected():
    with pytest.raises(ConfigError, match="num_classes"):
        LSHSoftmax(H, 1)
    with pytest.raises(ConfigError, match="in_features"):
        LSHSoftmax(0, C)
    with pytest.raises(ConfigError, match="config"):
        LSHSoftmax(H, C, config=LSHConfig(), bits=3)
    head = LSHSoftmax(H, C)
    with pytest.raises(ConfigError, match="num_classes=300"):
        head(torch.randn(2, H), torch.tensor([1, C]))
    with pytest.raises(ConfigError, match="-2.*-1 pads"):
        head(torch.randn(2, H), torch.tensor([[1, -1], [3, -2]]))
    with pytest.raises(ConfigError, match="inference"):
        head.eval()(torch.randn(2, H), inference="fast")


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.numel(), b.numel())
    return float(torch.corrcoef(torch.stack([a.flatten()[:n], b.flatten()[:n]]))[0, 1])


@pytest.mark.parametrize("seed", [0, 7])
def test_the_layers_random_draws_are_not_torchs_global_stream_for_the_same_seed(seed):
    # torch.manual_seed(s) then a model whose embeddings come first, and LSHSoftmax(seed=s):
    # the layer drew from Generator().manual_seed(s), the same numbers, so its SimHash
    # projections equalled the embedding's first rows (correlation 1.0) and its initial
    # weights were correlated with them (-0.35): hashes and init were tied to the model.
    torch.manual_seed(seed)
    embedding = nn.Embedding(C, H).weight.detach()
    torch.manual_seed(seed)
    linear = torch.empty(C, H).uniform_(-1, 1)
    head = LSHSoftmax(H, C, seed=seed, bits=8, tables=8)
    for drawn in (embedding, linear):
        assert abs(_corr(head.hasher.projection.t(), drawn)) < 0.1
        assert abs(_corr(head.hasher.projection, drawn)) < 0.1
        assert abs(_corr(head.weight.detach(), drawn)) < 0.1
    # still a function of the seed alone
    again = LSHSoftmax(H, C, seed=seed, bits=8, tables=8)
    assert torch.equal(again.weight, head.weight)
    assert torch.equal(again.hasher.projection, head.hasher.projection)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_simhash_layer_in_another_dtype_trains(dtype):
    head = LSHSoftmax(H, C, bits=4, tables=3, min_active=20).to(dtype)
    h = torch.randn(5, H, dtype=dtype, requires_grad=True)
    head(h, _labels(5)).backward()
    assert head.weight.grad is not None and h.grad.dtype == dtype
    head.eval()
    assert head(h.detach(), inference="lsh").dtype == dtype


def test_lsh_inference_keeps_only_classes_held_by_min_hits_tables_as_training_does():
    torch.manual_seed(0)
    head = LSHSoftmax(8, 500, bits=2, tables=4, min_hits=2, min_active=0, bucket_cap=500)
    h = torch.randn(3, 8)
    ids, row = head.tables.query(head.hasher(h))
    pairs, hits = torch.unique(row * 500 + ids, return_counts=True)
    held = pairs[hits >= 2]
    assert 0 < held.numel() < pairs.numel()  # min_hits=2 drops some pairs here
    head.eval()
    finite = torch.isfinite(head(h, inference="lsh"))
    got = finite.nonzero()
    assert torch.equal(got[:, 0] * 500 + got[:, 1], held)


def test_lazy_adam_runs_a_closure_with_gradients_and_returns_its_loss():
    head = LSHSoftmax(H, C, bits=4, tables=3)
    opt = LazyAdam(head.parameters(), lr=0.1)
    h, labels = torch.randn(4, H), _labels(4)
    before = head.weight.detach().clone()

    def closure():
        opt.zero_grad()
        loss = head(h, labels)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.requires_grad and not torch.equal(head.weight.detach(), before)


def test_lazy_adam_refuses_a_gradient_sparse_in_more_than_its_rows():
    p = nn.Parameter(torch.zeros(3, 4))
    opt = LazyAdam([p], lr=0.1)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 2]]), torch.tensor([1.0, -1.0]),
                                     (3, 4))  # fmt: skip
    with pytest.raises(ValueError, match=r"sparse_dim 2 for a parameter of shape \(3, 4\)"):
        opt.step()


def test_a_label_repeated_in_a_row_counts_once():
    head = LSHSoftmax(H, C, bits=3, tables=4, min_active=C)  # every class active: exact
    h = torch.randn(3, H)
    once = torch.tensor([[5, 9, -1], [7, -1, -1], [1, 2, 3]])
    twice = torch.tensor([[5, 9, 5], [7, 7, -1], [3, 2, 1]])
    assert torch.equal(head(h, once), head(h, twice))
    head.eval()
    logits = head(h)
    assert torch.equal(head.loss(logits, once), head.loss(logits, twice))


def test_redraw_every_draws_new_hash_functions_and_rehashes_and_resumes():
    def fresh() -> tuple[LSHSoftmax, LazyAdam]:
        head = LSHSoftmax(H, C, bits=3, tables=4, redraw_every=3, check_every=1000)
        return head, LazyAdam(head.parameters(), lr=0.05)

    head, opt = fresh()
    first = head.hasher.projection.clone()
    _train(head, opt, 2, seed=0)
    assert torch.equal(head.hasher.projection, first) and head.stats["redraws"] == 0
    before = head.weight.detach().clone()
    _train(head, opt, 1, seed=0)
    assert head.stats["redraws"] == 1 and int(head.draws) == 1
    assert not torch.equal(head.hasher.projection, first)
    # the tables hold the new functions' codes of the weights that step began with
    assert torch.equal(head.tables.codes, head.hasher(before))
    saved = _saved(head, opt)
    _train(head, opt, 4, seed=1)  # a second redraw at step 6
    assert int(head.draws) == 2
    other, other_opt = fresh()
    _restore(saved, other, other_opt)
    _train(other, other_opt, 4, seed=1)
    for name, value in head.state_dict().items():
        assert torch.equal(value, other.state_dict()[name]), name


def test_a_checkpoint_from_before_redraws_still_loads():
    head = LSHSoftmax(H, C, bits=3, tables=4)
    state = head.state_dict()
    del state["draws"]
    other = LSHSoftmax(H, C, bits=3, tables=4, seed=1)
    other.load_state_dict(state)
    assert int(other.draws) == 0 and torch.equal(other.tables.keys, head.tables.keys)
