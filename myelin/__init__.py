"""myelin: message-driven pipeline training for PyTorch models too big or slow for one device.

The public names load on first use (PEP 562): `from myelin import Trainer` and
`myelin.Trainer` work as eager imports would, while `myelin run` starts its ranks before
torch is imported in the launcher, so the two imports overlap instead of adding up."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "myelin.callbacks": ["Callback"],
    "myelin.errors": [
        "CheckpointError",
        "ConfigError",
        "DeadlineError",
        "DeviceMemoryError",
        "HostMemoryError",
        "LauncherLostError",
        "MessageError",
        "MyelinError",
        "PartitionError",
        "PeerLeftError",
        "PeerLostError",
        "RemoteError",
    ],
    "myelin.init": ["init_empty", "init_layers"],
    "myelin.offload.config": ["OffloadConfig"],
    "myelin.partition": ["StageModule", "balance", "layers_of", "split"],
    "myelin.profile.config": ["ProfileConfig"],
    "myelin.replicas.allreduce": ["AllReduce"],
    "myelin.replicas.daso": ["DASO"],
    "myelin.replicas.easgd": ["EASGD"],
    "myelin.replicas.hogbatch": ["Hogbatch"],
    "myelin.runtime.messages": ["Message", "MessageLimits"],
    "myelin.runtime.schedule": ["SCHEDULES", "Action"],
    "myelin.runtime.transport_config": ["TransportConfig"],
    "myelin.trainer": ["PipelineConfig", "Trainer"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [*_MODULE_OF, "__version__"]


def __getattr__(name: str) -> Any:
    """A public name from its module, or a subpackage (`myelin.nn`), imported on first use."""
    module = _MODULE_OF.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# What type checkers and IDEs read; tests/test_cli.py keeps it equal to _EXPORTS.
if TYPE_CHECKING:
    from myelin.callbacks import Callback
    from myelin.errors import (
        CheckpointError,
        ConfigError,
        DeadlineError,
        DeviceMemoryError,
        HostMemoryError,
        LauncherLostError,
        MessageError,
        MyelinError,
        PartitionError,
        PeerLeftError,
        PeerLostError,
        RemoteError,
    )
    from myelin.init import init_empty, init_layers
    from myelin.offload.config import OffloadConfig
    from myelin.partition import StageModule, balance, layers_of, split
    from myelin.profile.config import ProfileConfig
    from myelin.replicas.allreduce import AllReduce
    from myelin.replicas.daso import DASO
    from myelin.replicas.easgd import EASGD
    from myelin.replicas.hogbatch import Hogbatch
    from myelin.runtime.messages import Message, MessageLimits
    from myelin.runtime.schedule import SCHEDULES, Action
    from myelin.runtime.transport_config import TransportConfig
    from myelin.trainer import PipelineConfig, Trainer
