"""LSHSoftmax's tables follow its weights however they moved, its eval loss is exact under
inference="lsh", and a memory limit counts its sparse gradients as the rows they hold."""

from __future__ import annotations

import functools

import torch
from torch import nn

import myelin
from myelin.nn import LazyAdam, LSHSoftmax

H, C = 32, 2000


def _fresh(head: LSHSoftmax) -> bool:
    """Whether every class's codes in the tables are those of its weights now."""
    return torch.equal(head.hasher(head.weight.detach()), head.tables.codes)


def test_lsh_inference_after_fine_tuning_in_eval_mode_rehashes_the_moved_weights():
    # the exact eval logits carry a gradient; training them never marked a row moved, so
    # the tables kept the initial weights' codes (LSH top-1 agreed with exact on 8%)
    torch.manual_seed(0)
    head = LSHSoftmax(H, C, bits=6, tables=8, rebuild_threshold=0.05).eval()
    opt = LazyAdam(head.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        h, y = torch.randn(64, H, generator=g), torch.randint(C, (64,), generator=g)
        opt.zero_grad()
        head(h, y).backward()
        opt.step()
    assert bool(head.moved.all())  # every row could move, so every row is probed
    assert not _fresh(head)
    floor = head._gen.get_state()
    head.predict(head.weight[:100].detach(), 1, inference="lsh")
    assert head.stats["rebuilds"] == 1 and _fresh(head)
    assert torch.equal(head._gen.get_state(), floor)  # training's random stream untouched
    head.predict(head.weight[:100].detach(), 1, inference="lsh")  # no move since: no probe
    assert head.stats["rebuilds"] == 1 and head.stats["checks"] == 1


def test_lsh_inference_after_a_small_move_keeps_the_tables():
    # the probe's threshold decides, as in training: a move under it rebuilds nothing
    torch.manual_seed(0)
    head = LSHSoftmax(H, C, bits=6, tables=8, rebuild_threshold=0.5).eval()
    codes = head.tables.codes.clone()
    with torch.no_grad():
        head.weight[:5] += 1e-4
    head.moved[:5] = True
    head.predict(torch.randn(4, H), 1, inference="lsh")
    assert head.stats["checks"] == 1 and head.stats["rebuilds"] == 0
    assert torch.equal(head.tables.codes, codes)


def test_loading_only_the_weights_hashes_the_loaded_ones():
    # a dense layer's state (weight and bias, no tables) left the tables of the random
    # initial weights: LSH inference retrieved by those
    torch.manual_seed(0)
    dense = nn.Linear(H, C)
    head = LSHSoftmax(H, C, bits=6, tables=8)
    head.load_state_dict(dense.state_dict(), strict=False)
    assert torch.equal(head.weight, dense.weight) and _fresh(head)
    q = dense.weight[:200].detach()
    lsh = head.predict(q, 1, inference="lsh").squeeze(1)
    assert (lsh == torch.arange(200)).float().mean() > 0.5  # each weight finds its own class


def test_the_eval_loss_is_exact_when_the_layer_infers_by_lsh():
    # forward in eval returned LSH-only logits, which head.loss refused whenever a label
    # was not retrieved: Trainer.eval_step failed, depending on the batch
    torch.manual_seed(0)
    head = LSHSoftmax(16, 300, bits=6, tables=2, min_active=30, inference="lsh")
    m = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), head)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 24, generator=g), torch.randint(300, (8,), generator=g)
    with myelin.Trainer(m, functools.partial(LazyAdam, lr=0.05), head.loss) as t:
        t.step(x, y)
        got = t.eval_step(x, y)
    m.eval()
    with torch.no_grad():
        want = head.loss(head.logits(m[:2](x), "exact"), y)
        assert torch.isinf(head.logits(m[:2](x), "lsh").gather(1, y[:, None])).any()
    assert abs(got - float(want)) < 1e-6


def test_a_memory_limit_counts_the_layers_sparse_gradient_as_its_rows():
    # its gradient was counted as a dense (C, H) one: a limit the step fits was refused
    def run(limit):
        torch.manual_seed(0)
        head = LSHSoftmax(64, 20000, bits=8, tables=4, min_active=100)
        m = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), head)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(8, 24, generator=g), torch.randint(20000, (8,), generator=g)
        with myelin.Trainer(
            m,
            functools.partial(LazyAdam, lr=0.01),
            head.loss,
            device_memory_limit=limit,
            microbatches=2,
        ) as t:
            t.step(x, y)
            return t.memory_stats(), head

    stats, head = run("1GiB")
    grads = stats["device_peak_resident_bytes"]["gradients"]
    dense = 20000 * 65 * 4
    assert 0 < grads < dense / 4  # both microbatches' rows, with their indices
    assert grads >= (head.stats["last_active"]) * 65 * 4
    fits = stats["device_peak_bytes"] + 64 * 1024  # under what a dense count would need
    assert fits < stats["device_peak_bytes"] - grads + dense
    run(fits)
