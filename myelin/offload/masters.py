"""The parameters and the fp32 masters the optimizer steps for them (half precision,
optimizer offload): the parameters follow the masters, and an edit a user makes to a
parameter between steps goes into its master.

Under fp32 on the device the masters are the parameters and there is nothing to do. Else
an in-place edit of a parameter (`with torch.no_grad(): p.clamp_(-c, c)`, `nn.init.*`,
`p.copy_(...)`) would be used by the next forward but lost to the next update's copy
from the master, and missing from `state_dict()`. Such an edit moves the parameter's
version counter; one whose value is then not its master's, rounded, is the user's and
the master takes it (an edit through `p.data` has a version counter of its own: unseen).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MasterLink"]


class MasterLink:
    """`params[i]` and its master `masters[i]`; `stream`: the side stream whose copies to
    or from the masters may be in flight (None on a CPU)."""

    def __init__(
        self, params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor], stream: Any
    ) -> None:
        self.params, self.masters = list(params), list(masters)
        self.same = all(p is m for p, m in zip(self.params, self.masters, strict=True))
        self._stream = stream  # (not the updater's method: no cycle keeps the pool alive)
        self.noted()

    def _synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def noted(self) -> None:
        """The parameters are their masters' values now (myelin wrote them)."""
        self._versions = [p._version for p in self.params]

    def moved(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The masters of `params`, in order, for a replica strategy that moves the
        weights outside the optimizer; None when the masters are the parameters."""
        if self.same:
            return None
        index = {id(p): i for i, p in enumerate(self.params)}
        return [self.masters[index[id(p)]] for p in params]

    @torch.no_grad()
    def publish(self) -> None:
        """The parameters take their masters' values (rounded to theirs): after a replica
        strategy moved the masters."""
        if self.same:
            return
        self._synchronize()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)
        self.noted()

    @torch.no_grad()
    def adopt_edits(self) -> int:
        """Masters take the values of parameters edited in place since myelin last wrote
        them; returns how many."""
        if self.same:
            return 0
        edited = 0
        for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)):
            if p._version == self._versions[i]:
                continue
            self._synchronize()
            if not torch.equal(p, m.to(p.device, p.dtype)):
                m.copy_(p)
                edited += 1
            self._versions[i] = p._version
        return edited
