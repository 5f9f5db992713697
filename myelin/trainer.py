"""The drop-in wrapper users hold: split the model, join the world, train step by step.

    trainer = myelin.Trainer(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                             loss_fn=F.cross_entropy, stages=2, microbatches=8)
    loss = trainer.step(inputs, targets)

Every rank runs the same script (SPMD); each keeps only its own stage of the model. The
trainer assembles the parts and owns them: the settings (config.py), this rank's stage
(placement.py), its memory (offload/memory.py), the transport, heartbeats and event loop
(runtime/), the profile (profile/) and failure handling (failures.py). Loops over data
loaders are fit.py's, checkpoints checkpoint.py's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from myelin import checkpoint, collector, compiled, hf, pretrained, reshard, retry, teardown, whole
from myelin import fit as fit_loop
from myelin.config import PipelineConfig, check_callables, check_max_grad_norm, flight_dir_of
from myelin.errors import ConfigError, MyelinError
from myelin.failures import Failures
from myelin.layers import evaluating
from myelin.microbatch import split_batch, split_step
from myelin.offload.config import OffloadConfig, check_precision
from myelin.offload.memory import build_memory, memory_stats
from myelin.offload.pool import parse_bytes
from myelin.partition import split
from myelin.placement import check_every_stage_trains, layer_modules, stage_device
from myelin.profile.config import ProfileConfig
from myelin.profile.nvml import Sampler
from myelin.profile.report import ProfileReport, finish_profile, gather_report
from myelin.profile.timeline import Timeline
from myelin.replicas import Context, choose
from myelin.replicas.buffers import ReplicaBuffers
from myelin.runtime.bounded import Waits
from myelin.runtime.group import Layout, World, check_world_size, init_world
from myelin.runtime.liveness import Liveness
from myelin.runtime.loop import EventLoop, LoopConfig
from myelin.runtime.peers import connect_peers
from myelin.runtime.rng import LayerStreams
from myelin.runtime.schedule import make_policy
from myelin.runtime.stage import Stage
from myelin.runtime.transport import Transport, TransportConfig
from myelin.stage_setup import check_still_frozen, prepare_stage

__all__ = ["PipelineConfig", "Trainer", "split_batch"]


class Trainer:
    """Trains `model` split into `stages` pipeline stages, `data_parallel` times over.

    optimizer: called with this stage's parameters, e.g. partial(torch.optim.AdamW, lr=1e-3).
    loss_fn: loss_fn(output, target) -> scalar tensor, applied on the last stage. For a
        HuggingFace causal LM the default is its own loss (myelin.hf.CausalLMLoss): labels
        as HF takes them, the step's loss that of HF's forward on the whole batch.
    device: this rank's device; default its local GPU, else the CPU.
    profile: record every operation, wait and send (`trainer.timeline`) and sample GPU and
        memory counters; at close, print where each rank sat idle and why. A directory
        (profile="out/dir") also gets summary.json, trace.json and timeline.png; a
        myelin.profile.report.ProfileConfig sets the details.
    resume: a checkpoint directory written by `save`; training continues from it.
    weights: a folder written by `save_pretrained` (HuggingFace's layout, safetensors,
        sharded or not) to start from; each rank reads only its own stage's tensors, so a
        model built under `myelin.init_empty()` is never whole in any process.
    offload: a myelin.OffloadConfig: page activations and optimizer state out to host memory.
    precision: "fp32", "bf16" or "fp16" (with dynamic loss scaling); in half precision the
        optimizer updates fp32 master weights.
    device_memory_limit: bytes or "6GiB" this rank may use on its device. On a GPU it caps
        torch's allocator; elsewhere the runtime adds up parameters, gradients, optimizer
        state and saved activations and raises myelin.DeviceMemoryError past it.
    stage_devices: one device per stage, e.g. ["cuda", "cpu"], instead of `device`: a stage
        placed on the host CPU while the others use the accelerator.
    cpu_threads: torch threads on ranks computing on the CPU (an int, or one per stage).
    run_dir: where a failing rank writes its flight record (run_dir/flight/rankN.json):
        its last messages and operations. Default $MYELIN_RUN_DIR/flight, else
        ./myelin-flight.
    max_grad_norm: clip gradients by the norm of the whole model's gradient (every stage,
        replica and offload bucket), as torch.nn.utils.clip_grad_norm_ in one process.
    lr_schedule: called with this stage's optimizer, returns a torch LR scheduler
        (`trainer.lr_scheduler`), built before a checkpoint is loaded and saved with every
        checkpoint, so a resumed run continues it exactly. Step it after each step (`fit`
        does).
    Other keyword arguments are the fields of `PipelineConfig`.

    The optimizer factory gets the tensors it must step (fp32 masters under half precision
    or optimizer offload), named as in the whole model: `params.named_parameters()`. Each
    layer draws random numbers (dropout) from a stream of its own, seeded from
    `torch.initial_seed()` (what `torch.manual_seed` set), the layer and the replica.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: Callable[..., torch.optim.Optimizer],
        loss_fn: Callable[..., torch.Tensor] | None = None,
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
        weights: str | os.PathLike | None = None,
        offload: OffloadConfig | None = None,
        precision: str = "fp32",
        device_memory_limit: int | str | None = None,
        run_dir: str | os.PathLike | None = None,
        max_grad_norm: float | None = None,
        lr_schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
        sync: Any = "allreduce",
        stage_devices: Sequence[str | torch.device] | None = None,
        cpu_threads: int | Sequence[int | None] | None = None,
        tied_grads: str = "microbatch",
    ) -> None:
        self.seed = torch.initial_seed()  # the layers' random streams derive from it
        self.config = cfg = PipelineConfig(
            stages=stages,
            microbatches=microbatches,
            data_parallel=data_parallel,
            schedule=schedule,
            max_inflight=max_inflight,
            partition=partition,
            timeout=timeout,
            transport=transport if transport is not None else TransportConfig(),
            sync=sync,
            stage_devices=stage_devices,
            cpu_threads=cpu_threads,
            tied_grads=tied_grads,
        )
        model, self._compile_layer = compiled.unwrap(model)
        loss_fn = hf.own_loss(model) if loss_fn is None else loss_fn
        check_callables(optimizer, loss_fn, lr_schedule)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self._weights = pretrained.check_folder(weights) if weights is not None else None
        self._configs = pretrained.configs_of(model)  # written beside the weights
        self._profile = ProfileConfig.from_arg(profile)
        if offload is not None and not isinstance(offload, OffloadConfig):
            raise ConfigError(f"offload={offload!r} must be a myelin.OffloadConfig")
        self.offload = offload if offload is not None else OffloadConfig()
        self.precision = check_precision(precision)
        self.device_memory_limit = parse_bytes(device_memory_limit, "device_memory_limit")
        choose.check_supported(cfg.sync, bool(self.offload.optimizer), self.precision,
                               activations_offload=bool(self.offload.activations),
                               max_grad_norm=self.max_grad_norm,
                               microbatches=cfg.microbatches)  # fmt: skip
        flight_dir = flight_dir_of(run_dir)
        checkpoint.check_resume(resume)
        layout = Layout(cfg.stages, cfg.data_parallel)
        if cfg.stages > 1 or cfg.partition is not None:
            split(model, cfg.stages, cfg.partition)  # impossible splits fail before any work
            if self.precision == "fp16":
                check_every_stage_trains(model, cfg)
        check_world_size(layout)
        self._report: ProfileReport | None = None
        self.sampler: Sampler | None = None
        self._closed = False
        self._froze, self._steps_here = False, 0  # collector.freeze, after _freeze_at steps
        self.stateful_layers: list[nn.Module] | None = None  # retry.savepoint's, found once
        profiled = self._profile is not None  # frozen before the steady state it measures
        self._freeze_at = max(1, self._profile.warmup_steps) if profiled else collector.AFTER_STEPS
        self.transport: Transport | None = None
        self.liveness: Liveness | None = None
        chosen, any_cuda = stage_device(cfg, device, layout)
        self.world: World = init_world(layout, chosen, cfg.timeout, any_cuda)
        self._threads_before = teardown.set_threads(
            cfg.threads_of(self.world.stage), self.world.device
        )
        self._failures = Failures(self.world.rank, layout.world_size, flight_dir)
        self.flight = self._failures.flight
        try:
            self._build(model, optimizer, loss_fn)
            self.lr_scheduler = None
            self.resumed_scheduler_state = None
            if lr_schedule is not None:
                self.set_lr_schedule(lr_schedule)
            self.resumed_extra = checkpoint.load(self, resume) if resume is not None else None
        except BaseException as exc:
            try:
                if self.transport is not None:  # once connected, the peers are told why
                    self._failures.raise_failed(exc, "starting")
                raise
            finally:
                self.close()

    def _build(self, model: Any, optimizer: Callable, loss_fn: Callable) -> None:
        cfg, world = self.config, self.world
        prepared = prepare_stage(
            model,
            cfg,
            world,
            precision=self.precision,
            max_grad_norm=self.max_grad_norm,
            weights=self._weights,
            compile_layer=self._compile_layer,
        )
        self.module, self._state_layout = prepared.module, prepared.state_layout
        self._frozen = prepared.frozen  # unfreezing one later would train nothing: refused
        self.stage_layers = prepared.stage_layers  # what checkpoints move between layouts
        tied, clip, dtype = prepared.tied, prepared.clip, prepared.dtype
        self._memory = memory = build_memory(
            self.module,
            optimizer,
            prepared.initial,
            offload=self.offload,
            precision=self.precision,
            device_memory_limit=self.device_memory_limit,
            device=world.device,
            rank=world.rank,
            stage=world.stage,
            world_size=world.layout.world_size,
            same_host=world.same_host,
            names=prepared.names,
            clip=clip,
        )
        self.pool, self.budget, self.updater = memory.pool, memory.budget, memory.updater
        self.optimizer = self.updater.optimizer if self.updater is not None else None
        self._failures.budget = self.budget
        if world.layout.world_size > 1:
            self.transport, self.liveness = connect_peers(
                world, cfg.stages, cfg.transport, self.flight, lambda: self.flight_dir
            )
            self._failures.connected(self.transport, self.liveness, world)
            me = f"rank {world.rank} ({world.layout.describe(world.rank)})"
            world.waits = Waits(self.liveness, me, cfg.timeout)
            self._failures.catch_sigterm()
        self.streams = LayerStreams(
            self.seed, world.replica, layer_modules(self.module), world.device
        )
        stage = Stage(self.module, world.stage, cfg.stages, world.device, loss_fn,
                      memory.activations, dtype, streams=self.streams)  # fmt: skip
        self.timeline = Timeline.of_profile(self._profile, world.rank, world.stage, world.device)
        trains = self.updater is not None  # a stage without an optimizer has nothing to agree
        params = [p for p in self.module.parameters() if p.requires_grad and trains]
        context = Context(world, params, float(cfg.timeout), self.timeline, cfg.transport,
                          self.optimizer, tied)  # fmt: skip
        if self.updater is not None:  # what a strategy moves: the masters, if not the params
            link = self.updater.link
            context.moved, context.publish = link.moved(params), link.publish
        self.replicas = cfg.sync.build(context)  # how replicas agree (myelin/replicas/)
        self._buffers = ReplicaBuffers(self.module, world)  # equal when the model is read
        self.loop = EventLoop(
            stage,
            world,
            self.transport,
            make_policy(cfg.schedule, cfg.inflight),
            self.updater,
            LoopConfig(microbatches=cfg.microbatches, timeout_s=float(cfg.timeout),
                       tied_grads=cfg.tied_grads),  # fmt: skip
            self.timeline,
            tied=tied,
            budget=self.budget,
            flight=self.flight,
            liveness=self.liveness,
            clip=clip,
            replicas=self.replicas,
        )
        if self._profile is not None:
            self.sampler = Sampler(world.device, self._profile.interval_s, self.timeline.origin)
            self.sampler.start()
        self.steps_done = 0  # training steps
        self.seconds_trained = 0.0  # fit's time, in its checkpoints: a resumed budget goes on
        self.seq = 0  # training and evaluation steps: the step number messages carry
        self.checkpoint_version: Path | None = None  # loaded or saved last (checkpoint.py)

    def set_lr_schedule(self, lr_schedule: Callable[[torch.optim.Optimizer], Any]) -> Any:
        """Build `trainer.lr_scheduler = lr_schedule(trainer.optimizer)` (None on a stage with
        nothing to train), replacing any it had. The first one built after resuming from a
        checkpoint that holds a scheduler, before any step, continues it, and the optimizer
        keeps the learning rates the checkpoint left (building a torch scheduler resets them)."""
        if self.optimizer is None:
            self.lr_scheduler = None
            return None
        resumed_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.lr_scheduler = fit_loop.checked_scheduler(lr_schedule(self.optimizer), lr_schedule)
        saved, self.resumed_scheduler_state = self.resumed_scheduler_state, None  # once
        if saved is not None:
            reshard.load_scheduler(self.lr_scheduler, saved, "resuming the LR schedule")
            for group, lr in zip(self.optimizer.param_groups, resumed_lrs, strict=True):
                group["lr"] = lr
        return self.lr_scheduler

    @property
    def flight_dir(self) -> Path:
        """Where a failing rank writes its flight record (run_dir/flight)."""
        return self._failures.flight_dir

    @flight_dir.setter
    def flight_dir(self, path: Path) -> None:
        self._failures.flight_dir = Path(path)

    def memory_stats(self) -> dict[str, Any]:
        """This rank's memory: the device's peak (measured by torch.cuda on a GPU, else by
        the runtime's accounting) and what was resident, the host pool, what was paged
        out, how often backward found its activations back in time, resident memory (rss_bytes,
        rss_peak_bytes) and shared memory committed for sends (shm_committed_bytes)."""
        stats = memory_stats(self._memory, self.precision)
        stats["shm_committed_bytes"] = self.transport.shm_committed_bytes() if self.transport else 0
        return stats

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
        """Train one step on a batch; returns its mean loss, the same on every rank under
        AllReduce; under DASO and EASGD this replica's own (its stages agree; fit's rows
        average it over the replicas), as their replicas hold different models.

        `inputs` (a tensor or a tuple of tensors) and `targets` are split along dim 0
        into `microbatches`; or pass lists of per-microbatch inputs and targets, whose
        shapes may differ. Only stage 0 reads inputs and only the last stage targets.
        """
        if self.replicas is not None:
            self.replicas.check_step()  # Hogbatch's workers, not the script, take batches
        where = f"training step {self.steps_done + 1}"
        loss = self._run_batch(inputs, targets, self.loop.run_step, where)
        self.resumed_scheduler_state = None  # the checkpoint's position is behind us now
        self.steps_done += 1
        self._failures.leave(self.steps_done, self.seq - self.steps_done)
        self._steps_here += 1
        if self._steps_here == self._freeze_at:
            self._freeze()
        return loss

    def _freeze(self) -> None:
        """What lives now lives as long as the trainer: keep it out of the collector's scans."""
        if not self._froze:
            self._froze = collector.freeze()

    def eval_step(self, inputs: Any = None, targets: Any = None) -> float:
        """The mean loss of a batch without training on it (forward only, no gradients).

        Takes the same inputs as `step`; the model is in eval mode meanwhile.
        """
        self._check_usable()
        where = f"evaluation step {self.seq - self.steps_done + 1}"
        with evaluating(self.module), self.model_view():
            loss = self._run_batch(inputs, targets, self.loop.run_eval, where)
        self._failures.leave(self.steps_done, self.seq - self.steps_done)
        return loss

    def _run_batch(self, inputs: Any, targets: Any, run: Callable, where: str):
        """Split a batch into microbatches and `run` it through the loop; a failure is named
        (`where`, e.g. "training step 3") and told to the peers."""
        self._check_usable()
        mb_inputs, mb_targets, rows = split_step(inputs, targets, self.config.microbatches)
        self._failures.enter(where)
        saved = retry.savepoint(self)  # one rank alone forgets a step its update had not begun
        training = run == self.loop.run_step
        if training and self.updater is not None:
            self.updater.changed = False  # (nothing of this step is changed yet)
        try:
            if training:  # (inside: the peers are told, as of any failed step)
                check_still_frozen(self._frozen, self.world.rank)
            loss = run(self.seq, mb_inputs, mb_targets, rows, where)
        except BaseException as exc:
            forgotten = retry.forget_step(self, saved, exc, training=training)
            self._failures.raise_failed(exc, where, forgotten)
        self.seq += 1
        return loss

    # The loop over data loaders is fit.py's; these are its functions, so their signatures
    # and documentation live in one place: trainer.fit(loader, steps=..., ...).
    fit = fit_loop.fit
    evaluate = fit_loop.evaluate

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, under the original model's keys, on rank 0 (None on
        other ranks); every rank must call it. Load it into a plain PyTorch model to leave
        myelin."""
        self._check_usable()
        with self._failures.collective("state_dict()"), self.model_view():
            return whole.gather(self, self._state_layout)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the model as a HuggingFace folder (config.json and safetensors, one file
        per stage) that `AutoModelForCausalLM.from_pretrained(path)` loads, and
        `Trainer(..., weights=path)` too; every rank must call it."""
        self._check_usable()
        pretrained.require_safetensors("save_pretrained")
        with self._failures.collective("save_pretrained()"), self.model_view():
            pretrained.save(
                self.world, self.module, self._state_layout, path, self._configs, self.updater
            )

    def save(self, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
        """Checkpoint every rank's stage, optimizer, RNG and step; all ranks must call it.

        `extra` is plain data to keep with this rank's shard (a data position, say);
        `load` returns it. Returns the version written (`myelin.checkpoint`: guarantees).
        A failure (a peer lost at its barrier, a disk full) breaks the pipeline as a failed
        step does, and every rank hears of it."""
        self._check_usable()
        with self._failures.collective("a checkpoint save"):
            return checkpoint.save(self, path, extra)

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restore the newest complete checkpoint under `path`; returns this rank's extra.
        With several ranks a failure breaks the pipeline (this rank's state may be half
        restored) and every rank hears of it."""
        self._check_usable()
        with self._failures.collective("a checkpoint load"):
            self.resumed_extra = checkpoint.load(self, path)
        return self.resumed_extra

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
        with self._failures.collective("a profile gather"):
            return gather_report(self.timeline, self.world, self.sampler, self._profile)

    @contextlib.contextmanager
    def model_view(self) -> Iterator[None]:
        """While open, this stage's parameters hold what the model is under `sync`, and its
        buffers replica 0's on every replica (myelin/replicas/buffers.py); every rank must
        open it, as evaluation, state_dict() and save() do."""
        if self.updater is not None:  # parameters the user edited: their masters first
            self.updater.link.adopt_edits()
        view = self.replicas.model_view() if self.replicas else contextlib.nullcontext()
        with view, self._buffers.equal():
            yield

    def _check_usable(self) -> None:
        if self._closed:
            raise MyelinError("this Trainer is closed")
        self._failures.check_usable()

    def close(self) -> None:
        """Close sockets and the groups this trainer created; safe to call twice."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self._profile is not None and hasattr(self, "timeline"):
                failed = self._failures.ending
                self._report = finish_profile(
                    self.timeline, self.world, self.sampler, self._profile, failed=failed
                )
        except BaseException as exc:  # a peer lost in the gather: this rank's error too
            raise self._failures.fail(exc, "close()") from None
        finally:
            teardown.release(self)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if isinstance(error, Exception) and not self._closed:  # the script's own error:
            self._failures.script_failed(error)  # peers hear it now, not as a clean close
        self.close()
