"""One rank's memory, set up as `OffloadConfig` asks, and the figures that report it.

    memory = build_memory(module, optimizer, offload=..., precision=..., device=..., ...)
    memory_stats(memory, precision)      # what `Trainer.memory_stats()` returns

The parts: the device budget (what the device holds, checked against
`device_memory_limit`), the host pool (only when something is paged out; its default
limit shares the host's free memory between the ranks on it), the activation store (the
saved-tensor hooks) and the updater (the optimizer over fp32 masters, on the device, on
the host or streamed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from myelin.errors import ConfigError
from myelin.offload.activations import ActivationStore
from myelin.offload.budget import DeviceBudget
from myelin.offload.config import OffloadConfig
from myelin.offload.gradients import sparse_params
from myelin.offload.layers import Ahead
from myelin.offload.optimizer import Updater
from myelin.offload.pool import HostPool, default_host_limit

__all__ = ["Memory", "build_memory", "memory_stats"]


@dataclass(slots=True)
class Memory:
    """The memory parts of one rank's stage."""

    budget: DeviceBudget
    pool: HostPool | None
    updater: Updater | None  # None when the stage has nothing to train
    activations: ActivationStore
    fetch_ahead: int | str = 1  # OffloadConfig.fetch_ahead, as given


def build_memory(
    module: nn.Module,
    optimizer: Callable[..., torch.optim.Optimizer],
    initial: list[torch.Tensor] | None,
    *,
    offload: OffloadConfig,
    precision: str,
    device_memory_limit: int | None,
    device: torch.device,
    rank: int,
    stage: int,
    world_size: int,
    same_host: bool,
    names: list[str] | None = None,
    clip: Any = None,
) -> Memory:
    """The device budget, the host pool, the activation store and the updater of `module`
    (already in its training dtype); `initial` holds fp32 weights for half-precision masters,
    `names` the trainable parameters' names in the whole model, `clip` a GlobalNorm."""
    off = offload
    mode = off.optimizer_mode(device.type)
    pool = None
    if off.enabled:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        ranks_here = (
            int(local) if local.isdigit() and int(local) > 0 else (world_size if same_host else 1)
        )
        limit = off.host_memory_limit or default_host_limit(ranks_here)
        pool = HostPool(limit, slab_bytes=off.slab_bytes, pin=device.type == "cuda")
    offloading = tuple(
        c for c, on in (("activations", off.activations), ("optimizer", mode != "device")) if on
    )
    budget = DeviceBudget(
        device, device_memory_limit, where=f"rank {rank} (stage {stage})", offloading=offloading
    )
    nbytes = sum(t.numel() * t.element_size() for t in module.parameters())
    budget.set("parameters", nbytes, "placing the stage's parameters")
    params = [p for p in module.parameters() if p.requires_grad]
    updater = None
    if params:
        updater = Updater(
            params,
            optimizer,
            mode=mode,
            precision=precision,
            budget=budget,
            pool=pool,
            bucket_bytes=off.bucket_bytes,
            initial=initial,
            names=names,
            clip=clip,
            where=f"rank {rank} (stage {stage})",
            sparse=sparse_params(module),
        )
    elif precision == "fp16" and world_size > 1:
        raise ConfigError(
            f"precision='fp16': stage {stage} has no trainable parameters, but every "
            f"rank must vote on skipping steps whose gradients overflow"
        )
    activations = ActivationStore(
        device,
        budget,
        pool=pool if off.activations else None,
        min_bytes=off.min_bytes,
        prefetch=off.prefetch,
        ahead=Ahead(*off.ahead()),
        persistent=[*module.parameters(), *module.buffers()],
    )
    return Memory(budget, pool, updater, activations, off.fetch_ahead)


def memory_stats(memory: Memory, precision: str) -> dict[str, Any]:
    """This rank's memory: the device's peak (measured by torch.cuda on a GPU, else by
    the runtime's accounting) and what was resident, the host pool, what was paged
    out, and how often backward found its activations back in time."""
    budget, pool, updater = memory.budget, memory.pool, memory.updater
    stats = memory.activations.stats
    pool_stats = pool.stats() if pool is not None else {}
    return {
        "device_peak_bytes": budget.device_peak(),
        "device_peak_measured_by": "torch.cuda" if budget.measured else "accounting",
        "device_limit_bytes": budget.limit_bytes,
        "device_resident_bytes": dict(budget.resident),
        "device_peak_resident_bytes": dict(budget.peak_resident),
        "host_pool_peak_bytes": pool_stats.get("peak_bytes", 0),
        "host_pool_in_use_bytes": pool_stats.get("in_use_bytes", 0),
        "host_pool_capacity_bytes": pool_stats.get("capacity_bytes", 0),
        "host_pool_limit_bytes": pool_stats.get("limit_bytes"),
        "host_pool_grows": pool_stats.get("grows", 0),
        "activations_offloaded_bytes": stats.offloaded_step_bytes,
        "activations_offloaded_total_bytes": stats.offloaded_bytes,
        "activations_fetched_bytes": stats.fetched_step_bytes,
        "activations_stayed_bytes": stats.resident_step_bytes,
        "activation_layers": stats.layers,
        "fetch_ahead": memory.fetch_ahead,
        "optimizer_host_bytes": updater.host_bytes() if updater is not None else 0,
        "optimizer_mode": updater.mode if updater is not None else None,
        "precision": precision,
        "prefetch_hits": stats.prefetch_hits,
        "prefetch_misses": stats.prefetch_misses,
        "offload_wait_seconds": stats.wait_s,
        "loss_scale": updater.scaler.scale if updater and updater.scaler else None,
        "skipped_steps": updater.scaler.skipped if updater and updater.scaler else 0,
        **resident(),
    }


def resident() -> dict[str, int]:
    """This process's resident memory now and at its peak (VmRSS, VmHWM), in bytes; zeros
    where /proc does not say."""
    fields = {"VmRSS:": "rss_bytes", "VmHWM:": "rss_peak_bytes"}
    out = dict.fromkeys(fields.values(), 0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in fields:
                    out[fields[parts[0]]] = int(parts[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out
