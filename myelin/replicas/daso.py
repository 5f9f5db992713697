"""DASO (Coquelin et al. 2021), as Heat's `heat/optim/dp_optimizer.py` behaves.

Replicas of a stage form N nodes of G (`node_size`) replicas each. Gradients are averaged
inside a node (on the steps the local skip allows); every S steps one rank per node (the
sender group of local index `send_mod`, rotating) starts a non-blocking, chunked
all-reduce of its parameters across nodes, and B steps later merges the stale average
into its newer parameters, x <- (2B x + sum) / (2B + N), then broadcasts them inside its
node. Warm-up, cool-down and each epoch's last step average blocking (in bf16 where the
backend can). `daso_schedule.py` decides when; this module moves the bytes.

What the model is: the synchronised parameters, those of the last blocking average (each
epoch's end, every step of warm-up and cool-down), the same on every rank; evaluation,
state_dict() and checkpoints use them (`model_view`), while training goes on from this
rank's own parameters.

Deliberate differences from Heat, each because myelin must run where Heat cannot:
- G comes from `node_size` or LOCAL_WORLD_SIZE // stages, not the CUDA device count, and
  G = 1 is allowed (no local averaging, one global group); it runs on CPU (gloo) and GPU.
- Collectives are torch.distributed groups made inside each stage's replicas, not MPI;
  a pipeline runs DASO per stage, every stage following the same schedule (the loss the
  schedule sees is the same on every stage).
- Local skipping averages gradients itself instead of toggling DDP's
  `require_backward_grad_sync`; buffers (batch-norm statistics) are replica 0's when the
  model is read (replicas/buffers.py), as under every strategy.
- An epoch is `epoch_steps` steps (fit(epochs=...) sets it from the loader), and the
  plateau rule runs itself at the epoch's end with the mean loss over every replica,
  instead of the user calling `epoch_loss_logic`. As there (one all-reduce of the loss
  per epoch), no step averages its loss: `step()` returns this replica's own.
- The blocking downcast (bf16 by default) is probed on the backend once; where it fails it
  falls back to fp32 and says so. The sum is taken in that dtype as in Heat, but over
  torch's collective rather than a custom MPI op.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from myelin.errors import ConfigError, MyelinError
from myelin.replicas import Context, Strategy, own_state
from myelin.replicas.collectives import DOWNCAST, Collectives, summable
from myelin.replicas.daso_ops import chunks, make_groups, merge_stale
from myelin.replicas.daso_schedule import Average, DasoSchedule, Merge, Send
from myelin.replicas.flat import flatten, holding, moved_weights, unflatten
from myelin.runtime.tied import equalise

__all__ = ["DASO", "DasoReplicas", "merge_stale", "node_size_for"]

log = logging.getLogger(__name__)


def _int(name: str, value: Any, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if type(value) is not int or value < low:
        raise ConfigError(f"DASO({name}={value!r}): must be an int >= {low}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DASO:
    """DASO's settings, Heat's defaults. node_size: replicas per node (default
    LOCAL_WORLD_SIZE // stages); epoch_steps: steps per epoch (fit(epochs=...) sets it);
    total_epochs: where cool-down starts (fit(epochs=...) sets it; None: no cool-down)."""

    node_size: int | None = None
    epoch_steps: int | None = None
    total_epochs: int | None = None
    warmup_epochs: int = 4
    cooldown_epochs: int = 4
    max_global_skips: int = 8
    stability_level: float = 0.05
    sending_chunk_size: int = 10_000_000
    downcast: str = "bf16"
    skip_reduction_factor: int = 2
    local_skip_factor: int = 4

    name = "daso"
    # each replica applies its node's gradient (averaged inside the node on the steps the
    # local skip allows, its own on the others), never every replica's mean: max_grad_norm
    # clips it by its own norm, over its own pipeline ranks (stage_setup.py)
    own_gradients = True

    def __post_init__(self) -> None:
        _int("node_size", self.node_size, 1, optional=True)
        _int("epoch_steps", self.epoch_steps, 1, optional=True)
        _int("total_epochs", self.total_epochs, 1, optional=True)
        _int("warmup_epochs", self.warmup_epochs, 0)
        _int("cooldown_epochs", self.cooldown_epochs, 0)
        _int("max_global_skips", self.max_global_skips, 1)
        _int("sending_chunk_size", self.sending_chunk_size, 1)
        _int("skip_reduction_factor", self.skip_reduction_factor, 1)
        _int("local_skip_factor", self.local_skip_factor, 1)
        level = self.stability_level
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 <= level < 1:
            raise ConfigError(f"DASO(stability_level={level!r}): must be a number in [0, 1)")
        if not isinstance(self.downcast, str) or self.downcast not in DOWNCAST:
            raise ConfigError(f"DASO(downcast={self.downcast!r}): must be one of {list(DOWNCAST)}")

    def check(self, stages: int, data_parallel: int) -> None:
        """Raise before any work if the node size does not fit the replicas."""
        g = node_size_for(self, stages, data_parallel)
        if data_parallel % g:
            raise ConfigError(
                f"DASO(node_size={g}): data_parallel={data_parallel} replicas do not split "
                f"into nodes of {g}"
            )

    def build(self, ctx: Context) -> Strategy | None:
        """The running strategy on this rank (None with one replica)."""
        if ctx.world.layout.data_parallel == 1:
            return None
        return DasoReplicas(self, ctx)


def node_size_for(spec: DASO, stages: int, data_parallel: int) -> int:
    """Replicas per node: the setting, else the launcher's processes per host / stages."""
    if spec.node_size is not None:
        return spec.node_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_host = int(local) // stages if local.isdigit() else data_parallel
    return max(1, min(per_host, data_parallel))


class DasoReplicas(Strategy):
    """DASO on this rank: node-local gradient averages, stale global parameter averages."""

    reduces_gradients = True
    local_loss = True  # nodes hold different parameters between syncs: the loss is its own
    name = "daso"

    def __init__(self, spec: DASO, ctx: Context) -> None:
        world = self.world = ctx.world
        layout = world.layout
        self.spec, self.tied = spec, list(ctx.tied)
        self.params, self._moved, self.publish = moved_weights(ctx, "DASO")
        self.replicas = layout.data_parallel
        self.g = node_size_for(spec, layout.stages, self.replicas)
        self.nodes = self.replicas // self.g
        self.local_index = world.replica % self.g
        self.dp_group = world.dp_group
        self.local_group, self.global_groups = make_groups(world, self.g)
        self.schedule: DasoSchedule | None = None
        self.pending: dict[int, tuple[list[Any], list[torch.Tensor], int]] = {}
        self.comm = Collectives(getattr(world, "waits", None), ctx.timeline, "daso")
        self.downcast = self._probe(DOWNCAST[spec.downcast])
        self._epoch_steps, self._total = spec.epoch_steps, spec.total_epochs
        self.last_events: list[Any] = []  # the schedule's events of the last step
        # the parameters of the last blocking average; a checkpoint's load resets them from
        # the loaded ones (load_state_dict)
        self.synced = flatten(self.params)
        self._viewing = False

    def plan(self, epoch_steps: int | None, epochs: int | None) -> None:
        """fit(epochs=...) says how long an epoch is and how many run (unless set). With
        DASO(epoch_steps=N) of another length than the loader's, fit's epochs are counted
        in DASO's: the same steps, so the cool-down comes at the run's end."""
        if self.schedule is None:
            if self._total is None and epochs is not None:
                if self._epoch_steps is not None and epoch_steps is not None:
                    epochs = math.ceil(epochs * epoch_steps / self._epoch_steps)
                self._total = epochs
            self._epoch_steps = self._epoch_steps or epoch_steps
        elif epoch_steps is not None and epoch_steps != self._epoch_steps:
            log.warning(
                "DASO keeps the epoch length it planned (%d steps): this fit's loader has %d; "
                "DASO(epoch_steps=...) sets it for good",
                self._epoch_steps,
                epoch_steps,
            )

    def check_step(self) -> None:
        """Before any of the step's work: DASO must know its epoch length (the trainer stays
        usable, for fit(loader, epochs=E) or another trainer's settings)."""
        if self.schedule is None and self._epoch_steps is None:
            raise _no_epoch_length()

    def _sched(self) -> DasoSchedule:
        if self.schedule is None:
            if self._epoch_steps is None:
                raise _no_epoch_length()
            s = self.spec
            self.schedule = DasoSchedule(
                node_size=self.g,
                epoch_steps=self._epoch_steps,
                total_epochs=self._total,
                warmup_epochs=s.warmup_epochs,
                cooldown_epochs=s.cooldown_epochs,
                max_global_skips=s.max_global_skips,
                skip_reduction_factor=s.skip_reduction_factor,
                local_skip_factor=s.local_skip_factor,
                stability_level=float(s.stability_level),
                agree=lambda loss: self.comm.loss(loss, self.dp_group, self.replicas),
            )
        return self.schedule

    def _probe(self, dtype: torch.dtype) -> torch.dtype:
        """Whether the global groups' backend sums `dtype`; fp32 where it does not."""
        probe = self.global_groups[self.local_index]
        return summable(self.comm, probe, self.dp_group, dtype, "DASO's blocking averages")

    # -- the hooks -------------------------------------------------------------

    def backwards_done(self, params: list[torch.nn.Parameter], loss: float) -> float:
        """Average the gradients inside the node (when the schedule says so); the loss is
        this replica's own (the plateau rule averages the epoch's over every replica)."""
        if self._sched().local_sync and self.local_group is not None and params:
            had = [float(p.grad is not None) for p in params]
            for i, p in enumerate(params):
                if p.grad is not None and p.grad.is_sparse:
                    raise ConfigError(
                        f"DASO: parameter {i} of this stage {tuple(p.shape)} has a sparse "
                        "gradient (an LSHSoftmax's rows, an nn.Embedding(sparse=True)), which "
                        "the node's gradient average cannot sum: use node_size=1 or "
                        "sync=myelin.EASGD(...)"
                    )
            # the gradients, then whether each replica had one (counts <= node_size are
            # exact in any float): one with none in the whole node stays None for the
            # optimizer to skip; one that any replica had is everyone's, zeros included
            grads = torch.cat([_grad(p).reshape(-1) for p in params])
            flat = torch.cat([grads, torch.tensor(had, dtype=grads.dtype, device=grads.device)])
            self.comm.all_reduce(flat, self.local_group, "local")
            anyone = flat[grads.numel() :].tolist()
            flat = flat[: grads.numel()].div_(self.g)
            unflatten(flat, [p.grad for p in params])
            for p, used in zip(params, anyone, strict=True):
                if not used:
                    p.grad = None
        self._loss = loss
        return loss

    def eval_loss(self, loss: float) -> float:
        return self.comm.loss(loss, self.dp_group, self.replicas)

    def after_optimizer_step(self) -> None:
        """Run the step's DASO events: sends, merges, blocking averages."""
        self.last_events = self._sched().advance(self._loss)
        for event in self.last_events:
            if isinstance(event, Send):
                self._send(event)
            elif isinstance(event, Merge):
                self._merge(event)
            elif isinstance(event, Average):
                self._average(event)

    # -- the events ------------------------------------------------------------

    def _send(self, ev: Send) -> None:
        """The sender group packs its parameters and starts the chunked average."""
        if ev.group != self.local_index or not self.params:
            return
        # one node averages with itself: nothing to gain from a cast that only rounds
        dtype = self.downcast if ev.blocking and self.nodes > 1 else torch.float32
        flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in self.params])
        if torch.isnan(flat).any():
            raise MyelinError(f"DASO: NaN in the parameters sent at send {ev.id}")
        group = self.global_groups[ev.group]
        pieces = chunks(flat, self.spec.sending_chunk_size)
        works = []
        if group is not None:
            works = [self.comm.start(c, group, "global") for c in pieces]
        self.pending[ev.id] = (works, pieces, ev.wait)

    def _finish(self, send_id: int) -> tuple[torch.Tensor, int]:
        works, chunks, wait = self.pending.pop(send_id)
        for w in works:
            self.comm.wait(w, "global")
        return torch.cat(chunks), wait

    def _merge(self, ev: Merge) -> None:
        """x <- (w x + sum) / (w + N), w = 2B' (1 when B' = 0), on the sender group; then
        every node broadcasts from that group's rank."""
        if ev.id is not None and ev.group == self.local_index and self.params:
            total, wait = self._finish(ev.id)
            merge_stale(self.params, total, wait, self.nodes)
        self._broadcast(ev.group)
        equalise(self.tied, self.world, self._moved)  # each stage's sum rounds its own
        self.publish()

    def _average(self, ev: Average) -> None:
        """Blocking: the sender group takes the plain average, then every node copies it."""
        if ev.group == self.local_index and self.params:
            total, _ = self._finish(ev.id)
            avg = total / self.nodes
            unflatten(avg, self.params)
        self._broadcast(ev.group)
        equalise(self.tied, self.world, self._moved)
        self.publish()
        self.synced = flatten(self.params)

    @contextlib.contextmanager
    def model_view(self) -> Iterator[None]:
        """The parameters hold the synchronised ones while open; this rank's come back after."""
        if not self.params or self._viewing:  # nested views: the outer one holds it
            yield
            return
        self._viewing = True
        try:
            with holding(self.params, self.synced, self.publish) as own:
                self._own = own  # what a save inside the view keeps as this rank's
                yield
        finally:
            self._viewing = False

    def _broadcast(self, local_src: int) -> None:
        """Every rank of the node takes the parameters of its rank of local index `src`."""
        if self.local_group is None or not self.params:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        src = dist.get_global_rank(self.local_group, local_src)
        self.comm.broadcast(flat, src, self.local_group, "local")
        unflatten(flat, self.params)

    @property
    def bytes_local(self) -> int:
        """Bytes this rank put into its node's collectives (gradient averages, broadcasts)."""
        return self.comm.traffic["local"].bytes if "local" in self.comm.traffic else 0

    @property
    def bytes_global(self) -> int:
        """Bytes this rank put into averages across nodes (as one node's sender)."""
        return self.comm.traffic["global"].bytes if "global" in self.comm.traffic else 0

    def stats(self) -> dict[str, int]:
        s = self._planned()
        return {
            "local_bytes": self.bytes_local,
            "global_bytes": self.bytes_global,
            "sends": s.sends if s is not None else 0,
        }

    def _planned(self) -> DasoSchedule | None:
        """The schedule, or None while the epoch length is not known yet (before fit)."""
        return self._sched() if self.schedule is not None or self._epoch_steps else None

    def traffic(self) -> dict[str, dict[str, float]]:
        return self.comm.summary()

    # -- checkpoints ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The schedule, and each pending send waited for (flushed) and kept as its sum, so
        a resumed run merges exactly what the uninterrupted one would."""
        pending = {}
        for send_id in list(self.pending):
            total, wait = self._finish(send_id)
            self.pending[send_id] = ([], [total], wait)
            pending[str(send_id)] = {"sum": total.cpu(), "wait": wait}
        sched = self._planned()  # None: saved before any step and any plan
        state = {"strategy": self.name, "schedule": sched.state_dict() if sched else None}
        state["pending"] = pending
        state["epoch_steps"], state["total_epochs"] = self._epoch_steps, self._total  # as planned
        # this rank's own (a save inside a view: not the synced ones the view holds); the
        # checkpoint's model entries are the synced ones
        state["local"] = self._own.clone() if self._viewing else flatten(self.params)
        state["node_size"], state["nodes"] = self.g, self.nodes  # what the sends' sums are over
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The parameters were loaded with the checkpoint's model: they become the
        synchronised ones. With DASO's own state of this rank, the schedule, the pending
        sends and this rank's parameters come back; without it (another strategy's
        checkpoint, another layout) DASO starts afresh from the loaded parameters, its
        schedule from the first step. Sends in flight before the load are dropped."""
        for send_id in list(self.pending):
            self._finish(send_id)  # waited for, so no collective is left in flight
        self.schedule = None
        self.synced = flatten(self.params)
        own = own_state(state, self.name, "schedule")
        if own is None:
            return
        state = own
        # the plan the run was saved under (fit's, when DASO(...) left it open): a resumed
        # run loads before fit plans again, and must cool down where the first would have
        self._epoch_steps = self._epoch_steps or state.get("epoch_steps")
        self._total = self._total or state.get("total_epochs")
        saved = (state.get("node_size", self.g), state.get("nodes", self.nodes))
        if saved != (self.g, self.nodes):
            self._regrouped(state, *saved)
            return
        if state["schedule"] is not None:
            self._sched().load_state_dict(state["schedule"])
        unflatten(state["local"], self.params)
        self.publish()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.pending = {
            int(k): ([], [v["sum"].to(device)], int(v["wait"])) for k, v in state["pending"].items()
        }

    def _regrouped(self, state: dict[str, Any], node_size: int, nodes: int) -> None:
        """Resumed as other nodes: the phase and the skips carry on, but a pending send's
        sum is over the old nodes and its sender group another's, so it is dropped, and
        every replica goes on from the synchronised parameters (the checkpoint's model)."""
        log.warning(
            "DASO: the checkpoint was saved as %d node(s) of node_size=%d, this run is %d of "
            "node_size=%d: its pending send is dropped and every replica resumes from the "
            "synchronised parameters (the schedule's phase and skips carry on)",
            nodes, node_size, self.nodes, self.g,
        )  # fmt: skip
        if state["schedule"] is None:
            return
        sched = self._sched()
        sched.load_state_dict(state["schedule"])
        sched.pending, sched.send_mod_m1 = None, None
        sched.send_mod %= self.g


def _no_epoch_length() -> ConfigError:
    """The error of a step DASO cannot schedule: it does not know its epoch length."""
    return ConfigError(
        "DASO needs the epoch length: DASO(epoch_steps=N), or trainer.fit(loader, "
        "epochs=E) with a loader that has a len()"
    )


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
