"""`PipelineConfig`: how the model is split, scheduled and replicated; checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from myelin.errors import ConfigError
from myelin.replicas.choose import resolve_sync
from myelin.runtime.schedule import SCHEDULES
from myelin.runtime.transport_config import TransportConfig

__all__ = ["PipelineConfig"]


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
    sync: how the replicas of a stage agree: myelin.AllReduce() (default), myelin.DASO(...),
        myelin.EASGD(...), or one of the names "allreduce", "daso", "easgd".
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
        sync = resolve_sync(self.sync, self.stages, self.data_parallel)
        object.__setattr__(self, "sync", sync)

    @property
    def inflight(self) -> int:
        """Microbatches stage 0 lets into the pipeline at once: max_inflight, else stages."""
        return self.max_inflight if self.max_inflight is not None else self.stages


def _positive_int(name: str, value: Any) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{name}={value!r} must be an int >= 1")
