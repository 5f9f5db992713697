"""The exceptions myelin raises; each names what is wrong and what to do."""

from __future__ import annotations

__all__ = [
    "MyelinError",
    "ConfigError",
    "MessageError",
    "PartitionError",
    "DeadlineError",
    "RemoteError",
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
