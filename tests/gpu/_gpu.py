"""What the GPU tests share: GPU counts, a one-stage training run, and copy-stream delays."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import myelin
from myelin.models import GPT, GPTConfig, lm_loss

# Small enough to run in seconds, big enough that every saved activation is a real page
# (4 rows x 64 tokens x 128 wide in fp32 is 128 KiB) and the optimizer has several buckets.
SMALL = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, d_model=128)

# torch.cuda._sleep spins the GPU for this many clock cycles: about 10 ms at 2 GHz, longer
# at idle clocks. Queued on a copy stream ahead of a copy, it holds the copy back long
# enough for anything that does not wait for it to run first.
DELAY_CYCLES = 20_000_000


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int, why: str = "one per NCCL rank") -> pytest.MarkDecorator:
    """Skip, saying so, where fewer than `n` GPUs are visible (NCCL refuses two ranks on
    one GPU, so whatever runs over NCCL needs one GPU per rank)."""
    have = gpu_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} GPUs ({why}); this machine has {have}")


def one_gpu_env() -> dict[str, str]:
    """Environment that shows a job a single GPU, so its ranks share it even on a machine
    with several (the first of those visible now)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return {"CUDA_VISIBLE_DEVICES": visible or "0"}


def delay(stream: torch.cuda.Stream | None, cycles: int = DELAY_CYCLES) -> None:
    """Hold `stream` back: whatever is queued on it next starts `cycles` clocks later."""
    if stream is not None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)


def release() -> None:
    """Free what earlier runs left in torch's caching allocator, lift any cap that a
    `device_memory_limit` put on it (process-wide, it outlives the Trainer), and start the
    peak counters afresh."""
    import gc

    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.reset_peak_memory_stats()


def batches(cfg: GPTConfig, steps: int, rows: int, seed: int = 1) -> list[torch.Tensor]:
    """Token batches of (rows, block_size + 1), the same for every run with the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, cfg.vocab_size, (rows, cfg.block_size + 1), generator=g)
        for _ in range(steps)
    ]


@dataclass
class Run:
    losses: list[float]
    params: list[torch.Tensor]  # on the CPU, in the parameters' dtype
    masters: list[torch.Tensor]  # the optimizer's fp32 masters (the parameters in fp32)
    stats: dict[str, Any]

    def same_as(self, other: Run) -> bool:
        """Bit for bit: losses, parameters and masters."""
        return (
            self.losses == other.losses
            and all(torch.equal(a, b) for a, b in zip(self.params, other.params, strict=True))
            and all(torch.equal(a, b) for a, b in zip(self.masters, other.masters, strict=True))
        )

    def finite(self) -> bool:
        return all(torch.isfinite(torch.tensor(self.losses))) and all(
            bool(torch.isfinite(p.float()).all()) for p in self.params
        )


def train(
    cfg: GPTConfig = SMALL,
    steps: int = 3,
    *,
    microbatches: int = 4,
    rows_per_microbatch: int = 4,
    schedule: str = "gpipe",
    after_step: Callable[[myelin.Trainer, int], None] | None = None,
    **trainer_kwargs: Any,
) -> Run:
    """Train a one-stage GPT on this process's GPU (its default device) on fixed batches.

    GPipe by default: every microbatch but the last pages its activations out, which the
    message-driven order on one stage never does (its backward follows at once).
    """
    torch.manual_seed(0)
    trainer = myelin.Trainer(
        GPT(cfg),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        lm_loss,
        microbatches=microbatches,
        schedule=schedule,
        **trainer_kwargs,
    )
    assert trainer.world.device.type == "cuda", trainer.world.device
    with trainer:
        losses = []
        for step, x in enumerate(batches(cfg, steps, rows_per_microbatch * microbatches)):
            losses.append(trainer.step(x[:, :-1], x[:, 1:]))
            if after_step is not None:
                after_step(trainer, step)
        torch.cuda.synchronize()
        params = [p.detach().cpu().clone() for p in trainer.module.parameters()]
        masters = [m.detach().float().cpu().clone() for m in trainer.updater.masters]
        return Run(losses, params, masters, trainer.memory_stats())
