"""The exceptions myelin raises; each names what is wrong and what to do."""

from __future__ import annotations

__all__ = [
    "MyelinError",
    "CheckpointError",
    "ConfigError",
    "MessageError",
    "PartitionError",
    "DeadlineError",
    "RemoteError",
    "PeerLostError",
    "PeerLeftError",
    "LauncherLostError",
    "DeviceMemoryError",
    "HostMemoryError",
]


class MyelinError(Exception):
    """Base class of every error myelin raises on purpose."""


class ConfigError(MyelinError, ValueError):
    """A setting is invalid; raised before any process or socket starts."""


class MessageError(MyelinError, ValueError):
    """A message failed strict decoding; `field` names the offending header field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"bad message: {field}: {problem}")
        self.field = field
        self.problem = problem


class PartitionError(ConfigError):
    """The model cannot be split into the requested stages."""


class DeadlineError(MyelinError, TimeoutError):
    """A wait passed its deadline; the message says who waited for what."""


class RemoteError(MyelinError):
    """Another rank failed and told this one; the message carries its error."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank
        self.detail = detail


class PeerLostError(MyelinError):
    """A peer rank died or stopped answering; `rank` is the lost rank, `doing` what it was
    last doing. Every surviving rank raises it and stops."""

    def __init__(self, rank: int, doing: str, message: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.doing = doing


class PeerLeftError(PeerLostError):
    """A peer closed its trainer (or exited) while this rank still needed it: the ranks ran
    different numbers of steps or evaluations. The message names both ranks and where each
    was."""


class LauncherLostError(MyelinError):
    """The launcher that started this rank (`myelin run`, torchrun) is gone, so nothing
    could stop the rank any more: it stops by itself."""


class DeviceMemoryError(MyelinError, MemoryError):
    """A step would pass `device_memory_limit`; the message says what was resident on the
    device, the limit, and which offload option would help."""


class HostMemoryError(MyelinError, MemoryError):
    """The host memory pool would pass its limit (or the machine's free memory); the
    message gives the numbers and the setting to change."""


class CheckpointError(MyelinError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the model."""
