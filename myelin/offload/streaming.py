"""The "stream" optimizer mode (AxoNN's): state in the host pool, the update on the device.

Bucket by bucket, the fp32 masters and the optimizer state are copied to the device
(on a GPU on a side stream, the next bucket's copy overlapping this bucket's update),
the bucket is stepped there by giving only its masters gradients, the parameters take
the new values, and masters and state are copied back to their homes in the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from myelin.offload.pool import HostPool

if TYPE_CHECKING:
    from myelin.offload.state_homes import StateHomes

__all__ = ["Streamer", "is_paged", "nbytes"]


def is_paged(t: Any) -> bool:
    """Whether a state entry is per-parameter data (paged out), not a scalar like 'step'."""
    return isinstance(t, torch.Tensor) and t.dim() > 0


def nbytes(t: torch.Tensor) -> int:
    """The bytes of `t`'s elements."""
    return t.numel() * t.element_size()


class Streamer:
    """Steps `optimizer` over host-resident `masters` on `device`, one bucket at a time."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        masters: list[torch.Tensor],
        pool: HostPool,
        stream: Any,
        homes: StateHomes,
    ) -> None:
        self.optimizer = optimizer
        self.params = params
        self.masters = masters
        self.pool = pool
        self.stream = stream  # the side stream on a GPU, else None
        self.homes = homes  # pool room reserved for state the step creates
        self.device = params[0].device
        self.staging_peak = 0  # device bytes of two buckets' masters and state at once

    def step(self, buckets: list[list[int]], grads_for: Callable[[list[int]], None]) -> None:
        """Step every bucket; `grads_for(bucket)` gives only that bucket's masters grads."""
        staged = self._stage_in(buckets[0])
        for b in range(len(buckets)):
            following = b + 1 < len(buckets)
            ahead = self._stage_in(buckets[b + 1]) if following else None
            self._step_bucket(buckets[b], staged, ahead, grads_for)
            staged = ahead

    def _step_bucket(
        self,
        bucket: list[int],
        staged: dict[Any, Any],
        ahead: dict[Any, Any] | None,
        grads_for: Callable[[list[int]], None],
    ) -> None:
        """Step `bucket` on the device with its masters and state staged in (`ahead`: the
        next bucket's, already on its way), then copy them back out to the host pool."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(staged["ready"])
        homes = {}
        for i in bucket:
            m = self.masters[i]
            state = self.optimizer.state.get(m, {})
            homes[i] = (m.data, {k: v for k, v in state.items() if is_paged(v)})
            m.data = staged[i]["master"]
            for key, t in staged[i]["state"].items():
                state[key] = t
        grads_for(bucket)
        self.optimizer.step()
        with torch.no_grad():
            for i in bucket:
                self.params[i].copy_(self.masters[i])
        self._note_staging(staged, ahead)
        side = self.stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with (
            torch.cuda.stream(side) if side is not None else contextlib.nullcontext(),
            torch.no_grad(),
        ):
            for i in bucket:
                m = self.masters[i]
                home, home_state = homes[i]
                home.copy_(m.data, non_blocking=side is not None)
                if side is not None:
                    m.data.record_stream(side)
                m.data = home
                state = self.optimizer.state[m]
                for key, t in list(state.items()):
                    if not is_paged(t) or self.pool.owns(t):
                        continue
                    if key in home_state:
                        home_state[key].copy_(t, non_blocking=side is not None)
                        if side is not None:
                            t.record_stream(side)
                        state[key] = home_state[key]
                    else:  # created by this (first) step: its home was reserved
                        state[key] = self.homes.take(i, key, t)

    def _stage_in(self, bucket: list[int]) -> dict[Any, Any]:
        """Copies of a bucket's masters and state on the device (on a GPU, on the side
        stream; "ready" is the event that says they have arrived)."""
        side = self.stream
        staged: dict[Any, Any] = {}
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for i in bucket:
                m = self.masters[i]
                state = {
                    k: _to_device(v, self.device)
                    for k, v in self.optimizer.state.get(m, {}).items()
                    if is_paged(v)
                }
                staged[i] = {"master": _to_device(m.data, self.device), "state": state}
            if side is not None:
                staged["ready"] = torch.cuda.Event()
                staged["ready"].record(side)
        return staged

    def _note_staging(self, staged: dict[Any, Any], ahead: dict[Any, Any] | None) -> None:
        total = sum(
            nbytes(s["master"]) + sum(nbytes(t) for t in s["state"].values())
            for group in (staged, ahead or {})
            for k, s in group.items()
            if k != "ready"
        )
        self.staging_peak = max(self.staging_peak, total)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_like(t, device=device)
    out.copy_(t, non_blocking=device.type == "cuda")
    return out
