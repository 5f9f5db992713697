"""`ProfileConfig`: what `Trainer(profile=...)` records and where its report goes."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from myelin.errors import ConfigError

__all__ = ["ProfileConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    """What `Trainer(profile=...)` records and where the report goes.

    out_dir: where close() writes summary.json, trace.json, timeline.png (None: print only).
    interval_s: how often NVML and memory counters are sampled, in seconds.
    warmup_steps: steps left out of the steady-state figures.
    gather_timeout_s: how long rank 0 waits for the other ranks' records at close.
    print_summary: print the table on rank 0 at close.
    window_steps: keep every span of the last this many steps; older ones are folded into
        running totals, so the figures cover the whole run while memory stays flat (about
        4 KiB a step in `myelin train`'s default run: 2 stages, 4 microbatches). The trace
        and the picture show the window. None keeps every span.
    """

    out_dir: str | None = None
    interval_s: float = 0.1
    warmup_steps: int = 1
    gather_timeout_s: float = 60.0
    print_summary: bool = True
    window_steps: int | None = 200

    def __post_init__(self) -> None:
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise ConfigError(f"profile out_dir={self.out_dir!r} must be a path")
        if self.out_dir is not None:
            object.__setattr__(self, "out_dir", os.fspath(self.out_dir))
            if not self.out_dir:
                raise ConfigError("profile out_dir='' must name a directory (or be None)")
        if type(self.print_summary) is not bool:
            raise ConfigError(f"profile print_summary={self.print_summary!r} must be True/False")
        for name, lo, hi in (("interval_s", 0.001, 60.0), ("gather_timeout_s", 0.1, 3600.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"profile {name}={value!r} must be a number of seconds")
            if not lo <= value <= hi:
                raise ConfigError(f"profile {name}={value!r} must be in [{lo}, {hi}] seconds")
        if self.window_steps is not None and (
            type(self.window_steps) is not int or self.window_steps < 1
        ):
            raise ConfigError(
                f"profile window_steps={self.window_steps!r} must be an int >= 1 (or None: "
                f"keep every span)"
            )
        if type(self.warmup_steps) is not int or self.warmup_steps < 0:
            raise ConfigError(f"profile warmup_steps={self.warmup_steps!r} must be an int >= 0")

    @staticmethod
    def from_arg(profile: Any) -> ProfileConfig | None:
        """`Trainer(profile=...)`: False/None, True, an output directory, or a ProfileConfig.
        Its out_dir is made now: one that cannot be is said before training, not at close."""
        if profile is None or profile is False:
            return None
        if profile is True:
            return ProfileConfig()
        if isinstance(profile, (str, os.PathLike)):
            profile = ProfileConfig(out_dir=os.fspath(profile))
        if not isinstance(profile, ProfileConfig):
            raise ConfigError(
                f"profile={profile!r} must be True, an output directory, or a myelin ProfileConfig"
            )
        if profile.out_dir is not None:
            try:
                os.makedirs(profile.out_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"profile out_dir={profile.out_dir!r} cannot be made: {exc}"
                ) from None
        return profile
