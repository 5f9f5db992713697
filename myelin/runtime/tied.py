"""Tied parameters' gradients added per microbatch, in the order one process adds them.

A parameter that several stages hold (an embedding tied to the LM head) gets, in one
process, one gradient per use, and autograd adds a microbatch's pieces together before
adding the sum into `.grad`: Σ_i (e_i + h_i). Summing each holder's accumulated gradient
once per step, (Σ_i e_i) + (Σ_i h_i), rounds differently. With `tied_grads="microbatch"`:

1. a later holder's backward of microbatch i hands its piece h_i to a hook, which keeps it
   and lets zeros into its own `.grad`; the piece goes to the first holder as a `tied`
   message right after that backward (so it leaves before the gradient that will make
   the first holder's backward of i ready);
2. the first holder runs its backward of i only once every later holder's piece came, and
   its hook adds them to its own piece, as autograd's input buffer does, before `.grad`
   takes the sum;
3. at the step's end, after the replicas' reduction, the holders' gradients are summed
   as with `"step"`: the first holder's sum plus the others' zeros, so every holder
   steps with the same gradient. A strategy that moves parameters itself (EASGD, DASO)
   then makes the copies the first holder's (`equalise`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Tied", "MicrobatchTies", "equalise"]


class Tied(NamedTuple):
    """Parameters held by several stages of a replica, and how they are summed."""

    group: Any  # the process group of the holders
    params: list[nn.Parameter]  # this stage's copies
    holders: tuple[int, ...]  # the stages holding them, in order
    keys: list[int]  # each parameter's position in the whole model's parameter order


def equalise(tied: list[Tied], world: Any, moved: dict[int, torch.Tensor] | None = None) -> None:
    """Every holder's trainable tied copies take the first holder's values (one bounded
    broadcast per tie). For strategies that move each stage's parameters apart from the
    optimizer (EASGD's pulls, DASO's averages): each stage's collective (or hub slot)
    rounds, or orders, its copy differently, and a tied weight must stay one weight.
    `moved`: the tensor a strategy moves for a parameter (its fp32 master), by id."""
    for tie in tied:
        params = [p for p in tie.params if p.requires_grad]
        params = [moved.get(id(p), p) for p in params] if moved else params
        if not params:  # frozen on every holder alike: never moved
            continue
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        src = world.layout.rank_of(tie.holders[0], world.replica)
        begin = lambda: dist.broadcast(flat, src, group=tie.group, async_op=True)  # noqa: B023,E731
        if world.waits is None:
            begin().wait()
        else:
            world.waits.work(world.waits.start(begin), strict=False)
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


class MicrobatchTies:
    """This stage's side of per-microbatch tied gradients (see the module's docstring)."""

    def __init__(self, stage: int, tied: list[Tied], updater: Any = None) -> None:
        self.stage = stage
        self._updater = updater  # its gradients' holders: where a parameter's (fp32) .grad is
        self.sources: set[int] = set()  # later holders that send this stage their pieces
        self.expected: dict[int, dict[int, tuple[int, ...]]] = {}  # source -> key -> shape
        self._params: dict[int, nn.Parameter] = {}
        self._dest: dict[int, int] = {}  # key -> the first holder, for keys this stage sends
        self._incoming: dict[int, list[tuple[int, torch.Tensor]]] = {}  # key -> (source, piece)
        self._outgoing: dict[int, torch.Tensor] = {}  # key -> this stage's piece
        self._active = False  # hooks act only inside this stage's backward
        self._handles: list[Any] = []
        for tie in tied:
            first = tie.holders[0]
            for key, p in zip(tie.keys, tie.params, strict=True):
                if not p.requires_grad:  # frozen: no gradient to add, on any holder
                    continue
                self._params[key] = p
                if stage == first:
                    for source in tie.holders[1:]:
                        self.sources.add(source)
                        self.expected.setdefault(source, {})[key] = tuple(p.shape)
                    self._handles.append(p.register_hook(self._adding(key)))
                else:
                    self._dest[key] = first
                    self._handles.append(p.register_hook(self._keeping(key)))

    def close(self) -> None:
        """Take the hooks off the tied parameters (Trainer.close)."""
        for handle in self._handles:
            handle.remove()

    def check(self, source: int, keys: Any, tensors: list[torch.Tensor]) -> str | None:
        """Why a `tied` message from stage `source` cannot be taken, or None."""
        want = self.expected.get(source)
        if want is None:
            return f"tied gradients from stage {source}, which shares nothing with this stage"
        if not isinstance(keys, list) or len(keys) != len(tensors):
            return f"meta.keys={keys!r} does not list one key per tensor ({len(tensors)})"
        for key, t in zip(keys, tensors, strict=True):
            if type(key) is not int or key not in want:
                return f"tied parameter {key!r} is not one stage {source} shares with this stage"
            if tuple(t.shape) != want[key] or not t.is_floating_point():
                return (
                    f"tied gradient of parameter {key} is {t.dtype}{list(t.shape)}, "
                    f"expected a floating tensor of shape {list(want[key])}"
                )
        return None

    def before_backward(self, pieces: dict[int, tuple[list[int], list[torch.Tensor]]]) -> None:
        """Arm the hooks for one backward, with the later holders' pieces (by source)."""
        self._incoming = {}
        for source in sorted(pieces, reverse=True):  # the last stage's use is added first
            keys, tensors = pieces[source]
            for key, t in zip(keys, tensors, strict=True):
                self._incoming.setdefault(key, []).append((source, t))
        self._outgoing = {}
        self._active = True

    def after_backward(self) -> list[tuple[int, list[int], list[torch.Tensor]]]:
        """Disarm the hooks; add pieces no hook took (this stage's copy got no gradient);
        returns (first holder, keys, pieces) to send, one entry per first holder."""
        self._active = False
        with torch.no_grad():
            for key in list(self._incoming):
                holder = self._holder(self._params[key])
                total = self._sum(key).to(holder.device, holder.dtype)
                if holder.grad is None:
                    holder.grad = total.clone()
                else:
                    holder.grad.add_(total)
        out: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        for dest in sorted(set(self._dest.values())):
            out[dest] = ([], [])
        for key in sorted(self._outgoing):
            keys, tensors = out[self._dest[key]]
            keys.append(key)
            tensors.append(self._outgoing[key].detach().contiguous())
        self._outgoing = {}
        return [(dest, keys, tensors) for dest, (keys, tensors) in out.items()]

    def _holder(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor whose `.grad` accumulates `p`'s gradient: an fp32 carrier under bf16."""
        return self._updater.grads.holders_of([p])[0] if self._updater is not None else p

    def clear(self) -> None:
        """Forget a failed step's pieces."""
        self._incoming, self._outgoing, self._active = {}, {}, False

    def _sum(self, key: int) -> torch.Tensor:
        pieces = self._incoming.pop(key)
        total = pieces[0][1]
        for _, t in pieces[1:]:
            total = total + t
        return total

    def _adding(self, key: int):
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self._active or key not in self._incoming:
                return None
            return self._sum(key).to(grad.device, grad.dtype) + grad

        return hook

    def _keeping(self, key: int):
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self._active:
                return None
            self._outgoing[key] = grad
            return torch.zeros_like(grad)

        return hook
