"""A replica strategy's collectives: bounded by runtime/bounded.py and counted by kind.

Every all-reduce or broadcast a strategy makes goes through `Collectives`, so a peer that
dies or leaves during one is a PeerLostError or PeerLeftError naming it within the
heartbeat's seconds, never a hang, and each kind of communication ("gradients", "local",
"global", "exchange", "loss") has its bytes (what this rank put in), its count and the
seconds this rank waited for it, for `traffic()`, and for the profile's records (and so
the report and the run summary) where it is given the rank's timeline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DOWNCAST", "Collectives", "Traffic", "summable"]

log = logging.getLogger(__name__)
DOWNCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(slots=True)
class Traffic:
    """One kind of a strategy's communication on this rank."""

    bytes: int = 0  # payload this rank put into the collectives
    count: int = 0  # collectives started
    wait_s: float = 0.0  # seconds this rank waited for them to finish


class Collectives:
    """This rank's strategy collectives. waits: runtime/bounded.Waits (None in a world of
    one process, where nothing can be lost)."""

    def __init__(self, waits: Any, timeline: Any = None, strategy: str | None = None) -> None:
        self.waits = waits
        self.traffic: dict[str, Traffic] = {}
        if timeline is not None and strategy is not None:  # into the profile's records
            timeline.detail_sources["communication"] = lambda: {
                "strategy": strategy,
                "traffic": self.summary(),
            }

    def count(self, kind: str, nbytes: int, n: int = 1) -> None:
        """Count `nbytes` of `kind` that went out another way (the hub's messages)."""
        t = self.traffic.setdefault(kind, Traffic())
        t.bytes += nbytes
        t.count += n

    def waited(self, kind: str, seconds: float) -> None:
        self.traffic.setdefault(kind, Traffic()).wait_s += seconds

    def start(self, t: torch.Tensor, group: Any, kind: str, op: Any = None) -> Any:
        """Start an all-reduce of `t` over `group` (async); wait with `wait`."""
        self.count(kind, t.numel() * t.element_size())
        if self.waits is None:
            op = dist.ReduceOp.SUM if op is None else op
            return dist.all_reduce(t, op=op, group=group, async_op=True)
        return self.waits.issue(t, group, op)

    def wait(self, work: Any, kind: str) -> None:
        """Wait for a started collective, a slice at a time (a lost peer raises)."""
        start = time.perf_counter()
        try:
            if self.waits is None:
                work.wait()
            else:
                self.waits.work(work, strict=False)
        finally:
            self.waited(kind, time.perf_counter() - start)

    def all_reduce(self, t: torch.Tensor, group: Any, kind: str, op: Any = None) -> None:
        """A blocking all-reduce of `t` in place."""
        self.wait(self.start(t, group, kind, op), kind)

    def broadcast(self, t: torch.Tensor, src: int, group: Any, kind: str) -> None:
        """A blocking broadcast of `t` from global rank `src` over `group`."""
        self.count(kind, t.numel() * t.element_size())
        begin = lambda: dist.broadcast(t, src, group=group, async_op=True)  # noqa: E731
        self.wait(begin() if self.waits is None else self.waits.start(begin), kind)

    def loss(self, loss: float, group: Any, replicas: int) -> float:
        """The mean of `loss` over the `replicas` ranks of `group`."""
        t = torch.tensor([loss], dtype=torch.float64)
        self.all_reduce(t, group, "loss")
        return float(t.item()) / replicas

    def summary(self) -> dict[str, dict[str, float]]:
        """Each kind's bytes, count and wait seconds, as plain data."""
        return {kind: asdict(t) for kind, t in sorted(self.traffic.items())}


def summable(
    comm: Collectives, probe: Any, agree: Any, dtype: torch.dtype, who: str
) -> torch.dtype:
    """`dtype` if `probe`'s backend sums it on every rank of `agree` (a collective over
    `agree`; either group may be None, a group of one), else fp32, saying so: gloo
    builds without a bf16 or fp16 sum exist."""
    if dtype == torch.float32:
        return dtype
    ok = torch.ones(1)
    if probe is not None:
        try:
            comm.all_reduce(torch.ones(2, dtype=dtype), probe, "probe")
        except (RuntimeError, ValueError) as exc:
            ok.zero_()
            log.warning("%s: %s all-reduce failed on this backend (%s)", who, dtype, exc)
    if agree is not None:
        comm.all_reduce(ok, agree, "probe", op=dist.ReduceOp.MIN)
    if ok.item() == 0:
        log.warning("%s: falls back from %s to fp32", who, dtype)
        return torch.float32
    return dtype
