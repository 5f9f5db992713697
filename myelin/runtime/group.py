"""Where this process sits: rank layout, rendezvous and collectives via torch.distributed.

Rank r holds stage `r % stages` of replica `r // stages`, so the ranks of one
pipeline are consecutive (and, under torchrun, usually on one host). The
torch.distributed store that the rendezvous created also carries each rank's
ZeroMQ address, so there is no second rendezvous.
"""

from __future__ import annotations

import atexit
import ctypes
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from myelin.errors import ConfigError
from myelin.runtime import launched
from myelin.runtime.liveness import host_id

__all__ = [
    "Layout",
    "World",
    "init_world",
    "pick_device",
    "this_rank",
    "close_world",
    "new_groups",
    "sum_gradients",
]


@dataclass(frozen=True, slots=True)
class Layout:
    """The `stages x data_parallel` grid of ranks."""

    stages: int
    data_parallel: int

    @property
    def world_size(self) -> int:
        return self.stages * self.data_parallel

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def describe(self, rank: int) -> str:
        """Where `rank` sits, for messages: "stage 1, replica 0"."""
        return f"stage {self.stage_of(rank)}, replica {self.replica_of(rank)}"

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks holding `stage` in every replica (one data-parallel group)."""
        return [self.rank_of(stage, k) for k in range(self.data_parallel)]


@dataclass(slots=True)
class World:
    """This process's rank, device, store and collective groups."""

    rank: int
    layout: Layout
    device: torch.device
    store: Any = None
    dp_group: Any = None  # this stage's data-parallel process group, if data_parallel > 1
    same_host: bool = True
    owns_process_group: bool = False
    extra_groups: list[Any] = field(default_factory=list)
    waits: Any = None  # bounded, liveness-aware waits (runtime/bounded.py), once connected

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.rank)

    def peer(self, stage: int) -> int:
        """The rank holding `stage` in this process's replica."""
        return self.layout.rank_of(stage, self.replica)


def _env_world_size() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE={value!r} is not an integer") from None


def check_world_size(layout: Layout) -> int:
    """The world size this process runs in, checked against the layout before any work."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        source = "the initialized process group"
    else:
        world = _env_world_size()
        source = "WORLD_SIZE"
    if world is None:
        if layout.world_size != 1:
            raise ConfigError(
                f"stages={layout.stages} x data_parallel={layout.data_parallel} needs "
                f"{layout.world_size} processes, but this process was started alone; launch it "
                f"with `myelin run -n {layout.world_size} script.py` or "
                f"`torchrun --nproc-per-node {layout.world_size} script.py`"
            )
        return 1
    if world != layout.world_size:
        raise ConfigError(
            f"stages={layout.stages} x data_parallel={layout.data_parallel} needs a world of "
            f"{layout.world_size} processes, but {source} says {world}"
        )
    rank = os.environ.get("RANK")
    if not dist.is_initialized() and rank is not None:
        if not rank.isdigit() or int(rank) >= world:
            raise ConfigError(f"environment RANK={rank!r} must be an int in [0, {world - 1}]")
    return world


def pick_device(device: str | torch.device | None, field: str = "device") -> torch.device:
    """The device this rank computes on: the given one, else its local GPU, else the CPU.
    `field` names the setting in errors (e.g. "stage_devices[1]")."""
    if device is not None:
        if not isinstance(device, (str, torch.device)):
            raise ConfigError(f"{field}={device!r} must be a string like 'cuda:0' or 'cpu'")
        try:
            chosen = torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(f"{field}={device!r} is not a device torch knows: {exc}") from None
        if chosen.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0 or (chosen.index is not None and chosen.index >= count):
                raise ConfigError(
                    f"{field}={device!r}: this machine has {count} CUDA device(s); choose "
                    f"cuda:0..cuda:{count - 1}"
                    if count
                    else f"{field}={device!r}: no CUDA here"
                )
        if chosen.type == "cuda" and chosen.index is None:
            return _local_gpu()  # "cuda" alone: this rank's GPU, not every rank's cuda:0
        return chosen
    if torch.cuda.is_available():
        return _local_gpu()
    return torch.device("cpu")


def _local_gpu() -> torch.device:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % torch.cuda.device_count())


def _gpu_shared() -> bool:
    """Whether more ranks run on this host than it has GPUs: NCCL refuses two on one GPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return local_world > torch.cuda.device_count()


def this_rank() -> int:
    """This process's rank before the world is joined: the process group's, else RANK."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def init_world(
    layout: Layout, device: torch.device, timeout_s: float, any_cuda: bool = False
) -> World:
    """Join (or create) the process group and build this rank's data-parallel group.

    `any_cuda`: some rank computes on a GPU (stages on the host beside stages on a GPU),
    so every rank opens the same "cpu:gloo,cuda:nccl" backend."""
    world_size = check_world_size(layout)
    if world_size == 1 and not dist.is_initialized():
        return World(rank=0, layout=layout, device=device)
    owns = False
    if not dist.is_initialized():
        # any_cuda: a CPU stage beside GPU stages opens the same backend as they do
        nccl = (any_cuda or device.type == "cuda") and not _gpu_shared()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # kernels, events and NCCL on this rank's GPU
        me = os.environ.get("RANK", "")
        launched.tell(f"joining {me}")  # `myelin run` stops a wait for a rank that left
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if nccl else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if nccl and device.type == "cuda" else None,
        )
        launched.tell(f"joined {me}")
        # The default group lives as long as the process: a second Trainer in the same
        # script reuses it (re-creating it on the same store would find stale keys).
        atexit.register(_destroy_default_group)
        owns = True
    rank = dist.get_rank()
    world = World(rank=rank, layout=layout, device=device, owns_process_group=owns)
    world.store = dist.distributed_c10d._get_default_store()
    world.same_host = _all_same_host(world.store, rank, world_size, timeout_s)
    if layout.data_parallel > 1:
        for stage in range(layout.stages):  # every rank must create every group, in order
            group = dist.new_group(layout.replica_ranks(stage))
            world.extra_groups.append(group)
            if stage == world.stage:
                world.dp_group = group
    return world


def new_groups(world: World, stage_sets: list[tuple[int, ...]]) -> dict[tuple[int, ...], Any]:
    """One process group per set of stages in each replica; this rank's, by stage set.

    Every rank creates every group, in the same order, as torch.distributed requires.
    """
    mine = {}
    for stages in sorted(stage_sets):
        for replica in range(world.layout.data_parallel):
            ranks = [world.layout.rank_of(s, replica) for s in stages]
            group = dist.new_group(ranks)
            world.extra_groups.append(group)
            if world.rank in ranks:
                mine[stages] = group
    return mine


def _all_same_host(store: Any, rank: int, world_size: int, timeout_s: float) -> bool:
    """Whether every rank runs on this host (then ipc:// and shared memory are usable)."""
    me = host_id()  # network namespaces count as hosts: abstract ipc sockets are per netns
    store.set(f"myelin/host/{rank}", me)
    keys = [f"myelin/host/{r}" for r in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return all(store.get(k).decode() == me for k in keys)


def close_world(world: World, peer_lost: bool = False) -> None:
    """Destroy the data-parallel groups this trainer created; the default group stays.

    After a lost peer every group is abandoned instead: a collective that still waits on a
    silent peer blocks a gloo worker thread, and destroying its group (here, at exit, or
    when it is garbage-collected) joins that thread, so the rank would never exit. Each
    group keeps one reference that is never dropped; the operating system reclaims it."""
    if not dist.is_initialized():
        return
    if peer_lost:
        abandon_groups(world)
    else:
        for group in world.extra_groups:
            dist.destroy_process_group(group)
    world.extra_groups.clear()


def abandon_groups(world: World) -> None:
    """After a lost peer: this trainer's groups and the default one are never destroyed
    (see close_world), here, at exit or when garbage-collected; safe to call twice."""
    if not dist.is_initialized():
        return
    for group in [*world.extra_groups, dist.group.WORLD]:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    atexit.unregister(_destroy_default_group)
    world.extra_groups.clear()


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _all_reduce(t: torch.Tensor, group: Any, waits: Any, op: Any = None) -> None:
    """An all-reduce that a lost or departed peer cannot hang (with `waits`)."""
    if waits is None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    else:
        waits.all_reduce(t, op, group, strict=False)


def sum_gradients(params: list[torch.nn.Parameter], group: Any, waits: Any = None) -> None:
    """All-reduce (sum) the gradients of `params` over `group`, a missing one as zeros."""
    if not params:  # (every holder has the same list: all frozen, none calls the group)
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    _all_reduce(flat, group, waits)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
