"""Rejection warnings are throttled per kind, and what was held back is counted."""

from __future__ import annotations

import logging

from myelin.runtime import logs
from myelin.runtime.logs import Throttled


def test_each_kind_logs_a_burst_then_the_rest_are_counted(caplog, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    warn = Throttled(logging.getLogger("t"), burst=3, period_s=10)
    with caplog.at_level(logging.WARNING):
        for i in range(100):
            warn.warning("rank 1: stale: for step %d", i)
            warn.warning("rank 1: duplicate activation for microbatch %d", i)
        assert len(caplog.records) == 6  # 3 of each kind
        clock[0] = 11.0
        warn.warning("rank 1: stale: for step %d", 100)
    texts = [r.getMessage() for r in caplog.records]
    assert texts[-2] == "194 more rejections like those above in 11s were not logged"
    assert texts[-1] == "rank 1: stale: for step 100"


def test_endless_kinds_share_one_budget(caplog):
    warn = Throttled(logging.getLogger("t"), burst=1, period_s=60)
    with caplog.at_level(logging.WARNING):
        for i in range(1000):
            warn.warning("unknown control op %r", "x" * (i % 500 + 1))
    assert len(caplog.records) == logs._MAX_KINDS + 1
