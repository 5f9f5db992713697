"""A host pool too small for the optimizer state the first step creates: a clear error
that loses nothing (no bucket stepped, weights, masters and state as before)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import myelin

# 4 x 256 x 256 fp32 is 1 MiB of weights; 300 KiB buckets step them one layer at a time.
# Each limit holds what the trainer builds (masters, gradients) but not Adam's two
# moments, which the first step creates.
CASES = {
    "host": ("bf16", dict(optimizer=True, host_memory_limit="3MiB")),
    "stream": ("bf16", dict(optimizer="stream", host_memory_limit="2MiB")),
    "host-in-place": ("fp32", dict(optimizer=True, host_memory_limit="1MiB")),
}


def _trainer(precision: str, offload: dict) -> myelin.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    config = myelin.OffloadConfig(slab_bytes="1MiB", bucket_bytes="300KiB", **offload)
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    return myelin.Trainer(model, adam, nn.functional.mse_loss, precision=precision, offload=config)


def _snapshot(trainer: myelin.Trainer) -> dict[str, list[torch.Tensor]]:
    """Copies of what a failed step must leave alone."""
    updater = trainer.updater
    return {
        "weights": [p.detach().clone() for p in trainer.module.parameters()],
        "masters": [m.detach().clone() for m in updater.masters],
        "state": [
            t.clone()
            for s in updater.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ],
    }


@pytest.mark.parametrize("case", list(CASES))
def test_state_that_does_not_fit_fails_before_any_bucket_steps(case, roomy_machine, one_thread):
    precision, offload = CASES[case]
    trainer = _trainer(precision, offload)
    try:
        before = _snapshot(trainer)
        saved = trainer.state_dict()
        in_use = trainer.memory_stats()["host_pool_in_use_bytes"]
        x, y = torch.randn(8, 256), torch.randn(8, 256)
        with pytest.raises(myelin.HostMemoryError, match="host_memory_limit") as caught:
            trainer.step(x, y)
        assert "Nothing was changed" in str(caught.value)
        after = _snapshot(trainer)
        for what in before:
            assert len(after[what]) == len(before[what]), what
            for a, b in zip(after[what], before[what], strict=True):
                assert torch.equal(a, b), what
        assert not trainer.updater.optimizer.state  # no half-made state either
        assert trainer.memory_stats()["host_pool_in_use_bytes"] == in_use
        # one rank: the failed step is forgotten, the trainer usable (its weights readable)
        assert all(torch.equal(a, saved[k]) for k, a in trainer.state_dict().items())
        with pytest.raises(myelin.HostMemoryError, match="host_memory_limit"):
            trainer.step(x, y)
    finally:
        trainer.close()
