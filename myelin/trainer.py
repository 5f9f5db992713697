"""The drop-in wrapper users hold: split the model, join the world, train step by step.

    trainer = myelin.Trainer(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                             loss_fn=F.cross_entropy, stages=2, microbatches=8)
    loss = trainer.step(inputs, targets)

Every rank runs the same script (SPMD); each keeps only its own stage of the model.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from myelin import checkpoint
from myelin import fit as fit_loop
from myelin.errors import (
    ConfigError,
    DeviceMemoryError,
    MyelinError,
    PartitionError,
    PeerLostError,
    RemoteError,
)
from myelin.init import is_meta, materialize
from myelin.offload.activations import ActivationStore
from myelin.offload.budget import DeviceBudget
from myelin.offload.config import OffloadConfig, check_precision
from myelin.offload.optimizer import Updater
from myelin.offload.pool import HostPool, default_host_limit, parse_bytes
from myelin.partition import StageModule, cross_stage_ties, layers_of, split, stage_module
from myelin.precision import compute_dtype
from myelin.profile.config import ProfileConfig
from myelin.profile.nvml import Sampler
from myelin.profile.report import ProfileReport, finish_profile, gather_report
from myelin.profile.timeline import Timeline
from myelin.runtime.flight import FlightRecorder, default_dir
from myelin.runtime.group import (
    Layout,
    World,
    check_world_size,
    close_world,
    init_world,
    new_groups,
    pick_device,
)
from myelin.runtime.liveness import Liveness
from myelin.runtime.loop import EventLoop, LoopConfig
from myelin.runtime.schedule import SCHEDULES, make_policy
from myelin.runtime.stage import Stage
from myelin.runtime.transport import Transport, TransportConfig

__all__ = ["PipelineConfig", "Trainer", "split_batch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """How the model is split and scheduled; every field is checked when built.

    stages: pipeline stages (processes per replica).
    microbatches: microbatches per step; the batch must split into them evenly.
    data_parallel: replicas of the whole pipeline; gradients are averaged over them.
    schedule: "message-driven" (run what is ready), or the fixed "gpipe" / "1f1b".
    max_inflight: microbatches stage 0 lets into the pipeline at once (default: stages).
    partition: layers per stage, e.g. [3, 5]; default balances parameter counts.
    timeout: seconds any wait may last before it raises, naming what never came.
    """

    stages: int = 1
    microbatches: int = 1
    data_parallel: int = 1
    schedule: str = "message-driven"
    max_inflight: int | None = None
    partition: tuple[int, ...] | None = None
    timeout: float = 300.0
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "data_parallel"):
            _positive_int(name, getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.max_inflight is not None:
            _positive_int("max_inflight", self.max_inflight)
        if self.partition is not None:
            if not isinstance(self.partition, (list, tuple)):
                raise ConfigError(f"partition={self.partition!r} must be a list of layer counts")
            object.__setattr__(self, "partition", tuple(self.partition))
            if len(self.partition) != self.stages:
                raise ConfigError(
                    f"partition={list(self.partition)} lists {len(self.partition)} stages, "
                    f"but stages={self.stages}"
                )
            for c in self.partition:
                if type(c) is not int or c < 1:
                    raise ConfigError(
                        f"partition={list(self.partition)}: each entry must be an int >= 1"
                    )
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
            raise ConfigError(f"timeout={self.timeout!r} must be a number of seconds")
        if not 0 < self.timeout <= 86_400:
            raise ConfigError(f"timeout={self.timeout!r} must be in (0, 86400] seconds")
        if not isinstance(self.transport, TransportConfig):
            raise ConfigError(f"transport={self.transport!r} must be a myelin.TransportConfig")

    @property
    def inflight(self) -> int:
        return self.max_inflight if self.max_inflight is not None else self.stages


def _positive_int(name: str, value: Any) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{name}={value!r} must be an int >= 1")


class Trainer:
    """Trains `model` split into `stages` pipeline stages, `data_parallel` times over.

    optimizer: called with this stage's parameters, e.g. partial(torch.optim.AdamW, lr=1e-3).
    loss_fn: loss_fn(output, target) -> scalar tensor, applied on the last stage.
    device: this rank's device; default its local GPU, else the CPU.
    profile: record every operation, wait and send (`trainer.timeline`) and sample GPU and
        memory counters; at close, print where each rank sat idle and why. A directory
        (profile="out/dir") also gets summary.json, trace.json and timeline.png; a
        myelin.profile.report.ProfileConfig sets the details.
    resume: a checkpoint directory written by `save`; training continues from it.
    offload: a myelin.OffloadConfig: page activations and optimizer state out to host memory.
    precision: "fp32", "bf16" or "fp16" (with dynamic loss scaling); in half precision the
        optimizer updates fp32 master weights.
    device_memory_limit: bytes or "6GiB" this rank may use on its device. On a GPU it caps
        torch's allocator; elsewhere the runtime adds up parameters, gradients, optimizer
        state and saved activations and raises myelin.DeviceMemoryError past it.
    run_dir: where a failing rank writes its flight record (run_dir/flight/rankN.json):
        its last messages and operations. Default $MYELIN_RUN_DIR/flight, else
        ./myelin-flight.
    Other keyword arguments are the fields of `PipelineConfig`.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: Callable[..., torch.optim.Optimizer],
        loss_fn: Callable[..., torch.Tensor],
        *,
        stages: int = 1,
        microbatches: int = 1,
        data_parallel: int = 1,
        schedule: str = "message-driven",
        max_inflight: int | None = None,
        partition: Sequence[int] | None = None,
        timeout: float = 300.0,
        transport: TransportConfig | None = None,
        device: str | torch.device | None = None,
        profile: bool | str | os.PathLike | ProfileConfig = False,
        resume: str | os.PathLike | None = None,
        offload: OffloadConfig | None = None,
        precision: str = "fp32",
        device_memory_limit: int | str | None = None,
        run_dir: str | os.PathLike | None = None,
    ) -> None:
        self.config = PipelineConfig(
            stages=stages,
            microbatches=microbatches,
            data_parallel=data_parallel,
            schedule=schedule,
            max_inflight=max_inflight,
            partition=partition,
            timeout=timeout,
            transport=transport if transport is not None else TransportConfig(),
        )
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise ConfigError(
                f"optimizer={optimizer!r} must be a factory called with each stage's "
                f"parameters, e.g. functools.partial(torch.optim.AdamW, lr=1e-3), not an "
                f"optimizer instance"
            )
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn={loss_fn!r} must be callable: loss_fn(output, target)")
        self._profile = ProfileConfig.from_arg(profile)
        if offload is not None and not isinstance(offload, OffloadConfig):
            raise ConfigError(f"offload={offload!r} must be a myelin.OffloadConfig")
        self.offload = offload if offload is not None else OffloadConfig()
        self.precision = check_precision(precision)
        self.device_memory_limit = parse_bytes(device_memory_limit, "device_memory_limit")
        if run_dir is not None and (not isinstance(run_dir, (str, os.PathLike)) or not run_dir):
            raise ConfigError(f"run_dir={run_dir!r} must be a directory path")
        self.flight_dir = Path(run_dir) / "flight" if run_dir is not None else default_dir()
        if resume is not None:
            if not isinstance(resume, (str, os.PathLike)) or not resume:
                raise ConfigError(f"resume={resume!r} must be a checkpoint directory")
            try:  # a missing checkpoint fails before any work
                checkpoint.latest_version(resume)
            except checkpoint.CheckpointError as exc:
                raise ConfigError(f"resume={os.fspath(resume)!r}: {exc}") from None
        cfg = self.config
        layout = Layout(cfg.stages, cfg.data_parallel)
        if cfg.stages > 1 or cfg.partition is not None:
            split(model, cfg.stages, cfg.partition)  # impossible splits fail before any work
            if self.precision == "fp16":
                _check_every_stage_trains(model, cfg)
        check_world_size(layout)
        self._report: ProfileReport | None = None
        self.sampler: Sampler | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self.transport: Transport | None = None
        self.liveness: Liveness | None = None
        self._old_sigterm: Any = None
        self.world: World = init_world(layout, pick_device(device), cfg.timeout)
        try:
            self._build(model, optimizer, loss_fn)
            self.resumed_extra = checkpoint.load(self, resume) if resume is not None else None
        except BaseException:
            self.close()
            raise

    def _build(self, model: Any, optimizer: Callable, loss_fn: Callable) -> None:
        cfg, world = self.config, self.world
        self.module, tied = self._place_stage(model)
        dtype = compute_dtype(self.precision)
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        # Masters start from the fp32 weights, not from their half-precision rounding.
        initial = [p.detach().clone() for p in trainable] if dtype != torch.float32 else None
        self.module.to(dtype)
        params = [p for p in self.module.parameters() if p.requires_grad]
        activations = self._build_memory(params, optimizer, initial)
        if world.layout.world_size > 1:
            generation = world.store.add(f"myelin/trainers/{world.rank}", 1)
            self.transport = Transport(
                world.rank,
                world.layout.world_size,
                world.store,
                cfg.transport,
                prefix=f"myelin/t{generation}",
                same_host=world.same_host,
            )
            peers = [
                world.peer(s) for s in (world.stage - 1, world.stage + 1) if 0 <= s < cfg.stages
            ]
            self.transport.connect(peers)
        self.flight = FlightRecorder(world.rank)
        if self.transport is not None:
            t = cfg.transport
            self.liveness = Liveness(
                world.rank,
                world.layout.world_size,
                self._describe_rank,
                world.store,
                self.transport,
                self.flight,
                heartbeat_s=t.heartbeat_s,
                peer_timeout_s=t.peer_timeout_s,
                exit_after_loss_s=t.exit_after_loss_s,
                connect_timeout_s=t.connect_timeout_s,
                prefix=f"myelin/t{generation}",
                flight_dir=lambda: self.flight_dir,
            )
            self._catch_sigterm()
        stage = Stage(
            self.module, world.stage, cfg.stages, world.device, loss_fn, activations, dtype
        )
        self.loop = EventLoop(
            stage,
            world,
            self.transport,
            make_policy(cfg.schedule, cfg.inflight),
            self.updater,
            LoopConfig(microbatches=cfg.microbatches, timeout_s=float(cfg.timeout)),
            tied=tied,
            budget=self.budget,
        )
        self.loop.flight = self.flight
        self.loop.liveness = self.liveness
        profiling = self._profile is not None
        self.timeline = Timeline(world.rank, world.stage, profiling, device=world.device)
        self.loop.timeline = self.timeline
        if self._profile is not None:
            self.sampler = Sampler(world.device, self._profile.interval_s, self.timeline.origin)
            self.sampler.start()
        self.steps_done = 0  # training steps
        self._seq = 0  # training and evaluation steps: the step number messages carry

    def _build_memory(
        self, params: list[nn.Parameter], optimizer: Callable, initial: list[torch.Tensor] | None
    ) -> ActivationStore:
        """The device budget, the host pool, the activation store and the updater."""
        world, off = self.world, self.offload
        mode = off.optimizer_mode(world.device.type)
        self.pool: HostPool | None = None
        if off.enabled:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            ranks_here = (
                int(local)
                if local.isdigit() and int(local) > 0
                else (self.world_size if world.same_host else 1)
            )
            limit = off.host_memory_limit or default_host_limit(ranks_here)
            pin = world.device.type == "cuda"
            self.pool = HostPool(limit, slab_bytes=off.slab_bytes, pin=pin)
        offloading = tuple(
            c for c, on in (("activations", off.activations), ("optimizer", mode != "device")) if on
        )
        self.budget = DeviceBudget(
            world.device,
            self.device_memory_limit,
            where=f"rank {world.rank} (stage {world.stage})",
            offloading=offloading,
        )
        nbytes = sum(t.numel() * t.element_size() for t in self.module.parameters())
        self.budget.set("parameters", nbytes, "placing the stage's parameters")
        self.updater: Updater | None = None
        if params:
            self.updater = Updater(
                params,
                optimizer,
                mode=mode,
                precision=self.precision,
                budget=self.budget,
                pool=self.pool,
                bucket_bytes=off.bucket_bytes,
                initial=initial,
            )
        elif self.precision == "fp16" and self.world_size > 1:
            raise ConfigError(
                f"precision='fp16': stage {world.stage} has no trainable parameters, but every "
                f"rank must vote on skipping steps whose gradients overflow"
            )
        self.optimizer = self.updater.optimizer if self.updater is not None else None
        persistent = [*self.module.parameters(), *self.module.buffers()]
        return ActivationStore(
            world.device,
            self.budget,
            pool=self.pool if off.activations else None,
            min_bytes=off.min_bytes,
            prefetch=off.prefetch,
            persistent=persistent,
        )

    def memory_stats(self) -> dict[str, Any]:
        """This rank's memory: the device's peak (measured by torch.cuda on a GPU, else by
        the runtime's accounting) and what was resident, the host pool, what was paged
        out, and how often backward found its activations back in time."""
        budget, pool, store = self.budget, self.pool, self.loop.stage.activations
        stats = store.stats
        pool_stats = pool.stats() if pool is not None else {}
        updater = self.updater
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
            "optimizer_host_bytes": updater.host_bytes() if updater is not None else 0,
            "optimizer_mode": updater.mode if updater is not None else None,
            "precision": self.precision,
            "prefetch_hits": stats.prefetch_hits,
            "prefetch_misses": stats.prefetch_misses,
            "offload_wait_seconds": stats.wait_s,
            "loss_scale": updater.scaler.scale if updater and updater.scaler else None,
            "skipped_steps": updater.scaler.skipped if updater and updater.scaler else 0,
        }

    def _place_stage(self, model: Any) -> tuple[nn.Module, list[tuple[Any, list[nn.Parameter]]]]:
        """This rank's stage on its device, materialised if built under `init_empty`, with
        the process groups that keep parameters shared across stages equal."""
        cfg, world = self.config, self.world
        module = stage_module(model, cfg.stages, world.stage, cfg.partition)
        stages = [stage_module(model, cfg.stages, s, cfg.partition) for s in range(cfg.stages)]
        self._state_layout = checkpoint.state_layout(model, stages)
        ties = cross_stage_ties(model, cfg.stages, cfg.partition) if cfg.stages > 1 else {}
        names = {
            stages: [n for n, p in module.named_parameters() if id(p) in ids]
            for stages, ids in ties.items()
            if world.stage in stages
        }
        groups = new_groups(world, list(ties))
        materialized = is_meta(module)
        if materialized:
            if isinstance(module, StageModule):
                materialize(module, model, list(module), module.first_layer)
            else:
                materialize(module, model, _layers_or_whole(model), 0)
        module = module.to(world.device)
        tied = []
        for stages, group in groups.items():
            params = [module.get_parameter(n) for n in names[stages]]
            if materialized:  # each owner initialised its copy: take the first stage's
                src = world.layout.rank_of(stages[0], world.replica)
                for p in params:
                    dist.broadcast(p.data, src, group=group)
            tied.append((group, params))
        return module, tied

    # -- where this process sits ---------------------------------------------

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def stage(self) -> int:
        return self.world.stage

    @property
    def replica(self) -> int:
        return self.world.replica

    @property
    def world_size(self) -> int:
        return self.world.layout.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.world.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.world.stage == self.config.stages - 1

    # -- training --------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None) -> float:
        """Train one step on a batch; returns its mean loss, the same on every rank.

        `inputs` (a tensor or a tuple of tensors) and `targets` are split along dim 0
        into `microbatches`; or pass lists of per-microbatch inputs and targets, whose
        shapes may differ. Only stage 0 reads inputs and only the last stage targets.
        """
        self._check_usable()
        m = self.config.microbatches
        mb_inputs = split_batch(inputs, m, "inputs")
        mb_targets = split_batch(targets, m, "targets")
        try:
            loss = self.loop.run_step(self._seq, mb_inputs, mb_targets)
        except BaseException as exc:
            error = self._fail(exc, f"training step {self.steps_done}")
            if error is exc:
                raise
            raise error from exc
        self._seq += 1
        self.steps_done += 1
        return loss

    def eval_step(self, inputs: Any = None, targets: Any = None) -> float:
        """The mean loss of a batch without training on it (forward only, no gradients).

        Takes the same inputs as `step`; the model is in eval mode meanwhile.
        """
        self._check_usable()
        m = self.config.microbatches
        mb_inputs = split_batch(inputs, m, "inputs")
        mb_targets = split_batch(targets, m, "targets")
        self.module.eval()
        try:
            loss = self.loop.run_eval(self._seq, mb_inputs, mb_targets)
        except BaseException as exc:
            error = self._fail(exc, f"evaluation step {self._seq}")
            if error is exc:
                raise
            raise error from exc
        finally:
            self.module.train()
        self._seq += 1
        return loss

    def fit(self, loader: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """Train over a loader of (inputs, targets) with a progress bar; see `myelin.fit.fit`
        for steps, epochs, eval_loader, eval_every, log_every and callbacks."""
        return fit_loop.fit(self, loader, **kwargs)

    def evaluate(self, loader: Any, max_batches: int | None = None) -> float:
        """Mean loss over a loader's batches, forward only."""
        return fit_loop.evaluate(self, loader, max_batches)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, under the original model's keys, on rank 0 (None on
        other ranks); every rank must call it. Load it into a plain PyTorch model to leave
        myelin."""
        self._check_usable()
        return checkpoint.gather(self, self._state_layout)

    def save(self, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
        """Checkpoint every rank's stage, optimizer, RNG and step; all ranks must call it.

        `extra` is plain data to keep with this rank's shard (a data position, say);
        `load` returns it. See `myelin.checkpoint` for the layout and guarantees.
        """
        self._check_usable()
        checkpoint.save(self, path, extra)

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restore the newest complete checkpoint under `path`; returns this rank's extra."""
        self._check_usable()
        return checkpoint.load(self, path)

    def profile_report(self) -> ProfileReport:
        """Where every rank's time went so far: busy, idle by cause, overlap, per rank.

        While open it gathers from every rank, so call it on every rank (like `step`);
        after close it returns the report made at close. Needs `profile=`.
        """
        if self._profile is None:
            raise ConfigError(
                "profile_report() needs Trainer(..., profile=True) or profile='out/dir'"
            )
        if self._closed:
            if self._report is None:
                raise MyelinError("no profile was gathered at close; see the warning logged")
            return self._report
        self._check_usable()
        return gather_report(self.timeline, self.world, self.sampler, self._profile)

    def _check_usable(self) -> None:
        if self._closed:
            raise MyelinError("this Trainer is closed")
        if self._failed is not None:
            raise MyelinError(
                f"an earlier step failed and left the pipeline broken: {self._failed}"
            ) from self._failed

    def _fail(self, exc: BaseException, doing: str) -> BaseException:
        """Turn a failure into the error to raise: a lost peer (found by heartbeats) or an
        exhausted device named as such. Tell the other ranks, and write the flight record
        (its last lines go into the error's notes)."""
        error = exc
        if isinstance(exc, torch.OutOfMemoryError):
            error = self.budget.describe_oom(exc, doing)
        lost = self.liveness.find_lost() if self.liveness is not None else None
        if lost is not None and not isinstance(exc, (PeerLostError, DeviceMemoryError)):
            self.liveness.acknowledged = True
            error = PeerLostError(lost.rank, lost.doing, str(lost))
        self._failed = error
        if not isinstance(error, RemoteError):
            self._abort(error)
        if isinstance(error, Exception):
            self.flight.note(f"failed in {doing}: {type(error).__name__}")
            try:
                path = self.flight.dump(self.flight_dir, error)
                where = f"written to {path}"
            except Exception as write_exc:  # never hide the real error behind this one
                where = f"could not be written to {self.flight_dir}: {write_exc}"
            error.add_note(
                f"flight record of rank {self.rank}, last events:\n{self.flight.summary()}\n"
                f"(whole record {where})"
            )
        return error

    def _describe_rank(self, rank: int) -> str:
        layout = self.world.layout
        return f"stage {rank % layout.stages}, replica {rank // layout.stages}"

    def _catch_sigterm(self) -> None:
        """Launchers stop every rank with SIGTERM when one fails; raise the reason instead
        of dying silently: PeerLostError when a peer is gone."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the user's own handler stays

        def on_sigterm(signum: int, frame: Any) -> None:
            lost = self.liveness.find_lost() if self.liveness is not None else None
            if lost is not None:
                self.liveness.acknowledged = True
                raise PeerLostError(lost.rank, lost.doing, str(lost))
            raise MyelinError(f"rank {self.rank} got SIGTERM while {self.flight.doing}")

        self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _abort(self, exc: BaseException) -> None:
        """Tell every other rank this one failed, so none waits for it until a timeout."""
        if self.transport is None:
            return
        detail = f"{type(exc).__name__}: {exc}"[:2000]
        meta: dict[str, Any] = {"op": "abort", "error": detail}
        if isinstance(exc, PeerLostError):
            meta.update(lost=exc.rank, doing=exc.doing[:200])
        for r in range(self.world_size):
            if r != self.rank:
                try:
                    self.transport.send_control(r, meta)
                except Exception as send_exc:  # best effort: the peer may be gone too
                    log.debug("rank %d: could not tell rank %d: %s", self.rank, r, send_exc)

    def close(self) -> None:
        """Close sockets and the groups this trainer created; safe to call twice."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._profile is not None and hasattr(self, "timeline"):
            failed = self._failed is not None
            self._report = finish_profile(
                self.timeline, self.world, self.sampler, self._profile, failed=failed
            )
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        if self.liveness is not None:
            self.liveness.close()
        if self.transport is not None:
            self.transport.close()
        close_world(self.world)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_every_stage_trains(model: Any, cfg: PipelineConfig) -> None:
    """fp16 skips a step whose gradients overflow by a vote of every rank, so every stage
    needs parameters to vote with."""
    for s in range(cfg.stages):
        module = stage_module(model, cfg.stages, s, cfg.partition)
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(
                f"precision='fp16': stage {s} has no trainable parameters, but every stage "
                f"votes on skipping steps whose gradients overflow; use another partition or "
                f"precision='bf16'"
            )


def _layers_or_whole(model: Any) -> list[nn.Module]:
    try:
        return layers_of(model)
    except PartitionError:
        return [model]


def split_batch(batch: Any, microbatches: int, what: str) -> list[Any] | None:
    """Split a batch along dim 0 into microbatches; a list is taken as microbatches already."""
    if batch is None:
        return None
    if isinstance(batch, list):
        if len(batch) != microbatches:
            raise ConfigError(
                f"{what}: a list is taken as one entry per microbatch, got {len(batch)} entries "
                f"for microbatches={microbatches}"
            )
        return batch
    tensors = batch if isinstance(batch, tuple) else (batch,)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"{what}[{i}] is a {type(t).__name__}; pass tensors, a tuple of tensors, or a "
                f"list of per-microbatch entries"
            )
        if t.dim() == 0:
            raise ConfigError(f"{what}[{i}] is 0-d; a batch needs a leading batch dimension")
    size = tensors[0].shape[0]
    for i, t in enumerate(tensors):
        if t.shape[0] != size:
            raise ConfigError(f"{what}[{i}] has batch size {t.shape[0]}, but {what}[0] has {size}")
    if size == 0 or size % microbatches:
        raise ConfigError(
            f"{what}: a batch of {size} does not split into microbatches={microbatches}; "
            f"use a batch size divisible by {microbatches}, or pass a list of {microbatches} "
            f"microbatches"
        )
    chunks = [t.split(size // microbatches) for t in tensors]
    if isinstance(batch, tuple):
        return [tuple(c[i] for c in chunks) for i in range(microbatches)]
    return list(chunks[0])
