"""`PipelineConfig`: how the model is split, scheduled and replicated; checked when built.
Also the checks of the Trainer's other arguments that must pass before any work starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from myelin.errors import ConfigError
from myelin.replicas.choose import resolve_sync
from myelin.runtime.flight import default_dir
from myelin.runtime.schedule import SCHEDULES
from myelin.runtime.transport_config import TransportConfig

__all__ = [
    "PipelineConfig",
    "check_callables",
    "check_max_grad_norm",
    "flight_dir_of",
]

TIED_GRADS = ("step", "microbatch")  # how tied parameters' gradients are added (tied.py)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """How the model is split and scheduled; every field is checked when built.

    stages: pipeline stages (processes per replica).
    microbatches: microbatches per step; a batch splits into them along dim 0, evenly or
        (a short last batch) into sizes that differ by one row at most.
    data_parallel: replicas of the whole pipeline; gradients are averaged over them.
    schedule: "message-driven" (run what is ready), or the fixed "gpipe" / "1f1b".
    max_inflight: microbatches stage 0 lets into the pipeline at once (default: stages).
    partition: layers per stage, e.g. [3, 5]; default balances parameter counts.
    timeout: seconds any wait may last before it raises, naming what never came.
    sync: how the replicas of a stage agree: myelin.AllReduce() (default), myelin.DASO(...),
        myelin.EASGD(...), or one of the names "allreduce", "daso", "easgd"; or
        myelin.Hogbatch(...) ("hogbatch"), whose worker processes share one model in host
        memory (stages=1, data_parallel=1, plain SGD; train it with fit over a dataset).
    stage_devices: one device per stage, e.g. ["cuda", "cpu"]: a stage placed on the host
        CPU while the others use the accelerator (an LSH wide layer's stage, say); default
        every stage on its local GPU, else the CPU.
    cpu_threads: torch's intra-op threads on each rank computing on the CPU: one int for
        every such stage, or one entry (int or None: torch's default) per stage.
    tied_grads: how the gradients of parameters that several stages hold (an embedding
        tied to the LM head) are added: "microbatch" (default) sends each later holder's
        gradient of every microbatch to the first holder, which adds it as one process
        does (bit for bit; one tied gradient per microbatch on the wire), "step" sums each
        holder's gradient once per step (one all-reduce; equal to one process up to
        rounding), for large vocabularies across hosts.
    """

    stages: int = 1
    microbatches: int = 1
    data_parallel: int = 1
    schedule: str = "message-driven"
    max_inflight: int | None = None
    partition: tuple[int, ...] | None = None
    timeout: float = 300.0
    transport: TransportConfig = field(default_factory=TransportConfig)
    sync: Any = "allreduce"
    stage_devices: tuple[str, ...] | None = None
    cpu_threads: int | tuple[int | None, ...] | None = None
    tied_grads: str = "microbatch"

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "data_parallel"):
            _positive_int(name, getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.max_inflight is not None:
            _positive_int("max_inflight", self.max_inflight)
            if self.schedule in ("gpipe", "1f1b"):
                raise ConfigError(
                    f"max_inflight={self.max_inflight} bounds the message-driven schedules; "
                    f"schedule={self.schedule!r} is a fixed order, which sets how many "
                    f"microbatches are in flight itself"
                )
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
        sync = resolve_sync(self.sync, self.stages, self.data_parallel)
        object.__setattr__(self, "sync", sync)
        self._check_stage_devices()
        self._check_cpu_threads()
        if self.tied_grads not in TIED_GRADS:
            raise ConfigError(
                f"tied_grads={self.tied_grads!r} must be 'step' (sum once per step) or "
                f"'microbatch' (add per microbatch, bit for bit with one process)"
            )

    def _check_stage_devices(self) -> None:
        devices = self.stage_devices
        if devices is None:
            return
        if isinstance(devices, (str, torch.device)) or not isinstance(devices, (list, tuple)):
            raise ConfigError(
                f"stage_devices={devices!r} must be a list with one device per stage, "
                f"e.g. ['cuda', 'cpu']"
            )
        if len(devices) != self.stages:
            raise ConfigError(
                f"stage_devices={list(devices)} lists {len(devices)} devices, but "
                f"stages={self.stages}"
            )
        names = []
        for i, d in enumerate(devices):
            if not isinstance(d, (str, torch.device)):
                raise ConfigError(f"stage_devices[{i}]={d!r} must be a string like 'cpu'")
            try:
                kind = torch.device(d).type
            except RuntimeError as exc:
                raise ConfigError(f"stage_devices[{i}]={d!r} is not a device: {exc}") from None
            if kind not in ("cpu", "cuda"):
                raise ConfigError(f"stage_devices[{i}]={d!r} must be a 'cpu' or 'cuda' device")
            names.append(str(d))
        object.__setattr__(self, "stage_devices", tuple(names))

    def _check_cpu_threads(self) -> None:
        threads = self.cpu_threads
        if threads is None:
            return
        if isinstance(threads, (list, tuple)):
            if len(threads) != self.stages:
                raise ConfigError(
                    f"cpu_threads={list(threads)} lists {len(threads)} entries, but "
                    f"stages={self.stages}"
                )
            for i, n in enumerate(threads):
                if n is not None and (type(n) is not int or not 1 <= n <= 1024):
                    raise ConfigError(f"cpu_threads[{i}]={n!r} must be None or an int in [1, 1024]")
            object.__setattr__(self, "cpu_threads", tuple(threads))
        elif type(threads) is not int or not 1 <= threads <= 1024:
            raise ConfigError(
                f"cpu_threads={threads!r} must be an int in [1, 1024] or one entry per stage"
            )

    def threads_of(self, stage: int) -> int | None:
        """The CPU threads set for `stage` (None: leave torch's default)."""
        if isinstance(self.cpu_threads, tuple):
            return self.cpu_threads[stage]
        return self.cpu_threads

    @property
    def inflight(self) -> int:
        """Microbatches stage 0 lets into the pipeline at once: max_inflight, else stages."""
        return self.max_inflight if self.max_inflight is not None else self.stages


def _positive_int(name: str, value: Any) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{name}={value!r} must be an int >= 1")


def check_callables(optimizer: Any, loss_fn: Any, lr_schedule: Any = None) -> None:
    """The optimizer is a factory (each stage builds its own), the loss and the LR
    schedule functions."""
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise ConfigError(
            f"optimizer={optimizer!r} must be a factory called with each stage's "
            f"parameters, e.g. functools.partial(torch.optim.AdamW, lr=1e-3), not an "
            f"optimizer instance"
        )
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r} must be callable: loss_fn(output, target)")
    if lr_schedule is not None and not callable(lr_schedule):
        raise ConfigError(
            f"lr_schedule={lr_schedule!r} must be a function of the optimizer that returns "
            f"an LR scheduler"
        )


def check_max_grad_norm(value: Any) -> float | None:
    """max_grad_norm: None (no clipping) or a number > 0, as a float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"max_grad_norm={value!r} must be a number > 0 (or None: no clipping)")
    return float(value)


def flight_dir_of(run_dir: Any) -> Path:
    """Where flight records go: run_dir/flight, else $MYELIN_RUN_DIR/flight or ./myelin-flight."""
    if run_dir is None:
        return default_dir()
    if not isinstance(run_dir, (str, os.PathLike)) or not run_dir:
        raise ConfigError(f"run_dir={run_dir!r} must be a directory path")
    return Path(run_dir) / "flight"
