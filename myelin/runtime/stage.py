"""One pipeline stage on one device: forward and backward of single microbatches.

The stage keeps, per microbatch in flight, the inputs it received (as autograd
leaves) and the outputs it produced, so a later gradient message can run the
backward of exactly that microbatch. The last stage also applies the loss. What
autograd saves in between goes through an `ActivationStore`, which accounts it and,
when asked, pages it out to host memory until the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from myelin.errors import MyelinError
from myelin.losses import StepLoss, step_loss
from myelin.offload.activations import ActivationStore
from myelin.runtime.rng import LayerStreams
from myelin.runtime.split import SplitBackward

__all__ = ["InputMismatch", "Stage", "as_tuple"]


def as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    """A stage's inputs or outputs as a tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    got = type(value).__name__
    if isinstance(value, (tuple, list)):
        i, bad = next((i, v) for i, v in enumerate(value) if not isinstance(v, torch.Tensor))
        got += f" whose item {i} is {type(bad).__name__} (make it a tensor, or keep it out)"
    raise MyelinError(
        f"a pipeline stage must take and return a tensor or a tuple of tensors, got {got}"
    )


class InputMismatch(MyelinError):
    """A later stage's module failed on the tensors it received (the cause is chained)."""


@dataclass(slots=True)
class _Flight:
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    loss: torch.Tensor | None = None


class Stage:
    """Runs `module` as stage `index` of `num_stages` on `device`."""

    def __init__(
        self,
        module: nn.Module,
        index: int,
        num_stages: int,
        device: torch.device,
        loss_fn: Callable[..., torch.Tensor],
        activations: ActivationStore | None = None,
        dtype: torch.dtype = torch.float32,
        streams: LayerStreams | None = None,
    ) -> None:
        self.module = module
        self.activations = activations
        self.streams = streams  # the layers' random streams (runtime/rng.py)
        if activations is not None:
            activations.watch(module)
        self.dtype = dtype  # floating inputs are cast to it (bf16/fp16 training)
        self.loss_scale = 1.0  # fp16: the loss is multiplied by it before backward
        self.index = index
        self.num_stages = num_stages
        self.device = device
        self.loss_fn = loss_fn
        self.shares = isinstance(loss_fn, StepLoss)  # losses are shares of the step's: not divided
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self._flights: dict[int, _Flight] = {}
        self.split: SplitBackward | None = None  # backwards in two parts (split_backward)

    def forward(
        self,
        mb: int,
        inputs: tuple[torch.Tensor, ...],
        target: Any = None,
        divisor: int = 1,
        backward_next: bool = False,
        share: float | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Run the forward of microbatch `mb`; on the last stage, also its loss.

        The loss is divided by `divisor` (the microbatch count) before its backward,
        as in gradient accumulation, or multiplied by `share` (its rows over the batch's)
        when the batch split unevenly, unless it is already a share of the step's loss (a
        `myelin.losses.StepLoss`). `backward_next`: its backward runs right after, so
        the last layers of what autograd saves stay on the device. Returns the outputs to
        send on (last stage: ()).
        """
        inputs = tuple(self._receive(t) for t in inputs)
        saving = (
            self.activations.saving(mb, keep=inputs, backward_next=backward_next)
            if self.activations is not None
            else contextlib.nullcontext()
        )
        recording = self.split.recording(mb) if self.split is not None else contextlib.nullcontext()
        with saving, self._random(), recording:
            returned = self._run_module(tuple(_alias(t) for t in inputs))
            if not self.is_last:
                outputs = self._outputs(returned)
                self._flights[mb] = _Flight(inputs, outputs)
                return outputs
            loss = self.loss_fn(_for_loss(returned, self.dtype), _to(target, self.device))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise MyelinError(
                f"loss_fn must return a scalar tensor, got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        scaled = loss if loss.dim() == 0 else loss.reshape(())  # (no view node when scalar)
        if self.shares or (share is None and divisor == 1):
            pass  # a step's share already, or the whole step: x / 1 would be x, bit for bit
        else:
            scaled = scaled / divisor if share is None else scaled * share
        if self.loss_scale != 1.0:
            scaled = scaled * self.loss_scale
        self._flights[mb] = _Flight(inputs, (scaled,), loss.detach())
        return ()

    def _run_module(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        """The module on `inputs`; on a later stage, its failure is the sender's to explain
        (the loop names the microbatch and the rank the inputs came from)."""
        if self.is_first:
            return self.module(*inputs)
        try:
            return self.module(*inputs)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, (torch.OutOfMemoryError, MyelinError)):
                raise
            raise InputMismatch() from exc

    @torch.no_grad()
    def evaluate(
        self, inputs: tuple[torch.Tensor, ...], target: Any = None
    ) -> tuple[torch.Tensor, ...] | float:
        """Forward only, keeping nothing for backward: outputs, or the loss on the last stage."""
        inputs = tuple(self._cast(t) if self.is_first else self._move(t) for t in inputs)
        with self._random():
            returned = self.module(*inputs)
            if not self.is_last:
                return self._outputs(returned)
            loss = self.loss_fn(_for_loss(returned, self.dtype), _to(target, self.device))
        return float(loss)

    def _random(self) -> contextlib.AbstractContextManager:
        """The layers' own random streams while the module and the loss run."""
        return self.streams.scope() if self.streams is not None else contextlib.nullcontext()

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on this device, floating point cast to the stage's dtype."""
        dtype = self.dtype if t.is_floating_point() else t.dtype
        return t.to(self.device, dtype, non_blocking=True)

    def _outputs(self, value: Any) -> tuple[torch.Tensor, ...]:
        """The stage's outputs; a list is refused where it would cross to the next stage
        (there its tensors would become separate arguments, where one process passes the
        list as one), as a tuple's do."""
        if isinstance(value, list) and not self.is_last:
            raise MyelinError(
                f"stage {self.index}'s last layer returned a list; what crosses to the next "
                f"stage is a tensor or a tuple of tensors (a tuple's tensors become the next "
                f"layer's arguments): return a tuple"
            )
        return as_tuple(value)

    def _move(self, t: torch.Tensor) -> torch.Tensor:
        """An activation on this device in the dtype its stage sent (a float64 side input
        stays float64, as in one process)."""
        return t.to(self.device, non_blocking=True)

    def _receive(self, t: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            return self._cast(t)
        t = self._move(t.detach())
        if t.is_floating_point():
            t.requires_grad_(True)
        return t

    def step_targets(self, targets: list[Any]) -> list[Any]:
        """A step's per-microbatch targets as the loss takes them (a StepLoss's shares)."""
        return self.loss_fn.shares(targets) if self.shares else targets

    def step_loss(self, losses: list[float]) -> float:
        """The step's loss from its microbatches' losses, in microbatch order."""
        return step_loss(self.loss_fn, losses)

    def loss(self, mb: int) -> torch.Tensor:
        """The unscaled loss of microbatch `mb` (last stage only, after its forward), on the
        device: read as a number at the step's end, so the host is not held back by each
        microbatch's (on a GPU `float()` waits for everything queued before it)."""
        flight = self._flights[mb]
        assert flight.loss is not None
        return flight.loss.detach()

    def backward(
        self,
        mb: int,
        grads: list[torch.Tensor] | None = None,
        index: list[int] | None = None,
        split: bool = False,
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Run the backward of microbatch `mb` given the gradients of its outputs.

        `index` says which outputs `grads` belong to. Returns the gradients of the
        inputs that need one, and their positions, for the previous stage. `split`: only
        the input part (I); the linear layers' weight gradients wait for `backward_weight`.
        """
        flight = self._flights.pop(mb, None)
        if flight is None:
            raise MyelinError(f"stage {self.index}: backward of microbatch {mb} before its forward")
        if self.activations is not None:
            self.activations.fetch(mb)
        parts = self.split.backward(mb, split) if self.split is not None else None
        try:
            with parts or contextlib.nullcontext():
                self._backward(mb, flight, grads, index)
        finally:
            if self.activations is not None and not self.weights_wait(mb):
                self.activations.release(mb)  # else after W, which reads what forward saved
        if self.is_first:
            return [], []
        out_grads, out_index = [], []
        for i, t in enumerate(flight.inputs):
            if t.requires_grad and t.grad is not None:
                out_grads.append(t.grad)
                out_index.append(i)
        return out_grads, out_index

    def _backward(
        self, mb: int, flight: _Flight, grads: list[torch.Tensor] | None, index: list[int] | None
    ) -> None:
        if self.is_last:
            flight.outputs[0].backward()
        else:
            index = list(range(len(grads or []))) if index is None else index
            grads = grads or []
            if len(index) != len(grads):
                raise MyelinError(
                    f"stage {self.index}: microbatch {mb} got {len(grads)} gradients for "
                    f"outputs {index}"
                )
            pairs = []
            for j, g in zip(index, grads, strict=True):
                if not 0 <= j < len(flight.outputs):
                    raise MyelinError(
                        f"stage {self.index}: microbatch {mb} got a gradient for output {j}, "
                        f"but it has {len(flight.outputs)} outputs"
                    )
                out = flight.outputs[j]
                if tuple(g.shape) != tuple(out.shape):
                    raise MyelinError(
                        f"stage {self.index}: gradient of output {j} of microbatch {mb} has shape "
                        f"{tuple(g.shape)}, expected {tuple(out.shape)}"
                    )
                if out.requires_grad:
                    pairs.append((out, g.to(self.device, out.dtype, non_blocking=True)))
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])

    def split_backward(self, keep: list[torch.Tensor]) -> None:
        """Let backwards run split in two (I, then W: split.py), keeping the gradients of
        `keep` (tied parameters) in I. Not when activations are paged out: a page leaves
        once backward has read it, so W would find it gone; backwards then run whole."""
        if self.activations is None or not self.activations.pages_out:
            self.split = SplitBackward({id(p) for p in keep})

    def weights_wait(self, mb: int) -> bool:
        """Whether microbatch `mb`'s backward left weight gradients for `backward_weight`."""
        return self.split is not None and self.split.pending(mb)

    def backward_weight(self, mb: int) -> None:
        """The weight part (W) of a split backward of microbatch `mb`."""
        if not self.weights_wait(mb):
            return
        try:
            self.split.run(mb)
        finally:
            if self.activations is not None:
                self.activations.release(mb)

    def in_flight(self, mb: int) -> bool:
        """Whether microbatch `mb` has run forward here and waits for its backward."""
        return mb in self._flights

    def clear(self) -> None:
        """Forget every microbatch in flight (after a failed step)."""
        self._flights.clear()
        if self.split is not None:
            self.split.clear()
        if self.activations is not None:
            self.activations.clear()


class _Alias(torch.autograd.Function):
    """The received tensor under another name: the same memory and gradient, but not a leaf,
    so a stage whose first operation is in place (ReLU(inplace=True)) runs as it does in
    one process, where that tensor is the output of the layer before."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _alias(t: torch.Tensor) -> torch.Tensor:
    return _Alias.apply(t) if t.requires_grad else t


def _for_loss(value: Any, dtype: torch.dtype) -> Any:
    """What the loss function gets: the last layer's own return value (a tensor, a tuple,
    a dict...), as in one process, with floating tensors in fp32 when training in half
    precision, so the loss itself is computed in full precision."""
    if dtype == torch.float32:
        return value
    return _tensors_mapped(value, lambda t: t.float() if t.is_floating_point() else t)


def _to(value: Any, device: torch.device) -> Any:
    return _tensors_mapped(value, lambda t: t.to(device, non_blocking=True))


def _tensors_mapped(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `fn` applied to every tensor in it: through tuples, namedtuples, lists
    and dicts (a ModelOutput too), each rebuilt as its own type."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_tensors_mapped(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_tensors_mapped(v, fn) for v in value)
    if isinstance(value, dict):
        items = {k: _tensors_mapped(v, fn) for k, v in value.items()}
        return items if type(value) is dict else type(value)(**items)  # (a ModelOutput)
    return value
