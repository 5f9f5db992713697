"""Saved bytes remembered per input signature: the hooks are skipped only where the count
they would give is known, and the accounted peak is the one measured every step."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import myelin
from myelin.offload import saved
from myelin.offload.saved import RECHECK, SavedTally, signature


def test_tally_reuses_a_count_rechecks_it_and_stops_at_a_mismatch():
    tally = SavedTally()
    sig = signature(True, torch.zeros(2, 3))
    assert tally.known(sig) is None  # never measured
    tally.record(sig, 100)
    assert [tally.known(sig) for _ in range(RECHECK - 1)] == [100] * (RECHECK - 1)
    assert tally.known(sig) is None  # due to be measured again
    tally.record(sig, 100)
    assert tally.known(sig) == 100
    tally.record(sig, 120)  # the same inputs saved other bytes: the data decides
    assert not tally.enabled and tally.known(sig) is None
    assert SavedTally().known(None) is None  # inputs that were not described


def test_signatures_tell_shapes_dtypes_grad_and_scalars_apart():
    a = torch.zeros(2, 3)
    assert signature(a) == signature(torch.ones(2, 3))  # values do not matter
    others = [
        torch.zeros(2, 4),
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, 3, requires_grad=True),
    ]
    assert all(signature(a) != signature(b) for b in others)
    assert signature(True, (a,), {"y": a}, 4, None) != signature(True, (a,), {"y": a}, 2, None)
    assert signature(True, (a,), {"y": a}) != signature(True, (a,), {"z": a})
    assert signature(object()) is None and signature([a, object()]) is None


def _train(offload=None, limit=None, steps=6, model=None, batches=None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    trainer = myelin.Trainer(
        model,
        functools.partial(torch.optim.SGD, lr=0.1),
        nn.functional.mse_loss,
        microbatches=2,
        offload=offload,
        device_memory_limit=limit,
    )
    g = torch.Generator().manual_seed(1)
    with trainer:
        losses = []
        for i in range(steps):
            x = batches[i] if batches else torch.randn(8, 32, generator=g)
            losses.append(trainer.step(x, torch.zeros(x.shape[0], 32)))
        store = trainer.loop.stage.activations
        return losses, trainer.memory_stats(), store.tally


def test_reused_counts_give_the_peak_and_losses_of_measuring_every_forward(monkeypatch):
    losses, stats, tally = _train()
    assert tally.enabled and tally.reused > 0 and tally.measured >= 1
    monkeypatch.setattr(SavedTally, "known", lambda self, sig: None)  # measure every forward
    every_losses, every_stats, every_tally = _train()
    assert every_tally.reused == 0
    assert losses == every_losses
    assert stats["device_peak_bytes"] == every_stats["device_peak_bytes"] > 0
    assert stats["device_peak_resident_bytes"] == every_stats["device_peak_resident_bytes"]
    assert stats["device_peak_resident_bytes"]["activations"] > 0


def test_a_new_input_shape_is_measured_not_guessed():
    g = torch.Generator().manual_seed(2)
    small = [torch.randn(8, 32, generator=g) for _ in range(4)]
    big = torch.randn(64, 32, generator=g)
    _, stats, tally = _train(steps=5, batches=[*small, big])
    _, big_stats, _ = _train(steps=1, batches=[big])
    # the big batch's activations are counted: its peak is the one a run of it alone sees
    assert (
        stats["device_peak_resident_bytes"]["activations"]
        == (big_stats["device_peak_resident_bytes"]["activations"])
    )
    assert tally.measured >= 2


def test_an_accounted_limit_or_paging_measures_every_forward():
    _, _, tally = _train(limit="1GiB")
    assert not tally.enabled and tally.reused == 0
    _, _, tally = _train(offload=myelin.OffloadConfig(activations=True))
    assert tally.reused == 0


class _Gate(nn.Module):
    """Saves a number of rows that follows the data: the same shapes, other bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x[:, 0] > 0
        out = x.clone()
        out[keep] = torch.tanh(self.lin(x[keep]))
        return out


def test_saved_bytes_that_follow_the_data_turn_reuse_off(monkeypatch):
    monkeypatch.setattr(saved, "RECHECK", 2)  # measure every other forward
    g = torch.Generator().manual_seed(3)
    batches = []
    for i in range(8):
        x = torch.randn(8, 32, generator=g).abs()
        x[: i % 4 + 1, 0] *= -1  # 1 to 4 rows of each microbatch's 4 skip the layer
        batches.append(x)
    _, _, tally = _train(model=_Gate(), steps=8, batches=batches)
    assert not tally.enabled


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode_is_part_of_the_signature(grad):
    with torch.set_grad_enabled(grad):
        sig = signature(torch.is_grad_enabled(), torch.zeros(1))
    assert sig != signature(not grad, torch.zeros(1))
