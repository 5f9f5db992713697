"""myelin: message-driven pipeline training for PyTorch models too big or slow for one device."""

from myelin.callbacks import Callback
from myelin.errors import (
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
from myelin.runtime.transport import TransportConfig
from myelin.trainer import PipelineConfig, Trainer

__version__ = "0.1.0"

__all__ = [
    "Action",
    "AllReduce",
    "DASO",
    "EASGD",
    "Hogbatch",
    "Callback",
    "ConfigError",
    "DeadlineError",
    "DeviceMemoryError",
    "HostMemoryError",
    "LauncherLostError",
    "Message",
    "MessageError",
    "MessageLimits",
    "MyelinError",
    "OffloadConfig",
    "PartitionError",
    "PeerLeftError",
    "PeerLostError",
    "PipelineConfig",
    "ProfileConfig",
    "RemoteError",
    "SCHEDULES",
    "StageModule",
    "Trainer",
    "TransportConfig",
    "balance",
    "init_empty",
    "init_layers",
    "layers_of",
    "split",
    "__version__",
]
