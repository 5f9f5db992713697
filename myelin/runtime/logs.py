"""Warnings about rejected input, throttled: a flood of junk must not become a flood of logs."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

__all__ = ["Throttled"]

_MAX_KINDS = 64  # kinds of warning tracked apart; past that, they share one budget
_NUMBERS = re.compile(r"\d+")


class Throttled:
    """Logs at most `burst` warnings of each kind per `period_s` (a kind: the message with
    its numbers left out) and then says how many it held back."""

    def __init__(self, logger: logging.Logger, burst: int = 10, period_s: float = 10.0) -> None:
        self.logger = logger
        self.burst = burst
        self.period_s = period_s
        self._start = time.monotonic()
        self._counts: dict[str, int] = {}
        self._held = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._start >= self.period_s:
            if self._held:
                self.logger.warning(
                    "%d more rejections like those above in %.0fs were not logged",
                    self._held,
                    now - self._start,
                )
            self._start, self._counts, self._held = now, {}, 0
        kind = _NUMBERS.sub("#", msg % args if args else msg)
        if kind not in self._counts and len(self._counts) >= _MAX_KINDS:
            kind = "(other)"
        seen = self._counts.get(kind, 0)
        if seen < self.burst:
            self._counts[kind] = seen + 1
            self.logger.warning(msg, *args)
        else:
            self._held += 1
