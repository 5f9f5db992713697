"""One pipeline stage of a HuggingFace causal LM: the model's own forward, over its layers.

The model's layers are [embeddings, block 0, ..., block n-1, head] (see shape.py); a stage
holds a contiguous run of them and runs the *whole model's* forward (use_cache=False), so
masks, positions, rotary tables, embedding scales, sliding windows and logit soft-capping
are each family's own code on every stage. For the length of one forward, what the stage
does not hold is stood in for:
- the embeddings, on a later stage: zeros of the right shape and dtype;
- blocks before the stage's own: they pass their input through, and the stage's first
  block takes the hidden state received from the previous stage instead of its input (a
  stage holding only the head gets it from the last block's stand-in);
- a stage that does not end the model stops right after its last block (or, holding
  only the embeddings, at the input of the first block);
- the head, on an earlier stage: never reached.
Between stages travel the hidden state and the inputs stage 0 was given: (hidden,
input_ids[, attention_mask[, position_ids]]), from which every stage rebuilds masks and
positions. If the model's forward uses a module on the other side of the blocks than the
probe found it on (shape.py), a stand-in is reached at the wrong moment and says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from myelin.errors import MyelinError, PartitionError
from myelin.hf.probe import shaped_zeros, swapped
from myelin.hf.shape import AUX_LOSS, BY_HAND, Found, find
from myelin.layers import StageModule

__all__ = ["INPUTS", "Ends", "HFStage", "layers_of"]

INPUTS = ("input_ids", "attention_mask", "position_ids")  # what stage 0 takes, in order


class Ends(nn.Module):
    """The modules before (or after) the blocks, as one pipeline layer. Submodules keep
    their own names (their full path where two share one); `paths` maps them back."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.paths: dict[str, str] = {}
        leaves = [path.rpartition(".")[2] for path in modules]
        for path, module in modules.items():
            leaf = path.rpartition(".")[2]
            name = leaf if leaves.count(leaf) == 1 else path.replace(".", "_")
            self.add_module(name, module)
            self.paths[name] = path

    def forward(self, *args: object) -> None:  # noqa: D102
        raise MyelinError("a HuggingFace model's embeddings and head run inside its own forward")


def layers_of(model: nn.Module) -> list[nn.Module]:
    """[embeddings, blocks..., head] of a HuggingFace causal LM."""
    found = find(model)
    return [Ends(found.before), *found.blocks, Ends(found.after)]


class _Stop(Exception):  # noqa: N818 (control flow, never seen outside this module)
    """Ends a stage's forward with its output hidden state: raised right after its last
    block (or, for a stage of embeddings only, at the input of the first block)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


@dataclass(slots=True)
class _Call:
    """What the stand-ins share during one forward."""

    hidden: torch.Tensor | None = None  # received from the previous stage
    dtype: torch.dtype = torch.float32  # of this stage's parameters
    took_hidden: bool = False  # the received hidden state has entered the blocks


class _StandIn(nn.Module):
    """A stand-in that answers for the module it replaces: a model's forward may read its
    attributes (Nemotron-H a block's `block_type`, Llama 4 the embedding's `weight`)."""

    stood_for: list  # [the real module], or [] (a list: not this stand-in's submodule)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("stood_for") or [None]
            if real[0] is None or name.startswith("__"):
                raise
            return getattr(real[0], name)


def _tuple_of(hidden: torch.Tensor, items: int) -> torch.Tensor | tuple:
    """What a block of the family returns, for a stand-in: the hidden state alone, or a
    tuple of `items` with it first (the rest None: no cache, no attentions)."""
    return (hidden, *([None] * (items - 1))) if items else hidden


class _Embedding(_StandIn):
    """A module run before the blocks, on a later stage: zeros shaped as its output would
    be (the blocks' first input is replaced by the received hidden state anyway)."""

    def __init__(self, path: str, real: nn.Module, call: _Call) -> None:
        super().__init__()
        self.path, self.call, self.real = path, call, [real]  # a list: not our weights
        self.stood_for = self.real
        self.dim = real.embedding_dim if isinstance(real, nn.Embedding) else None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: D102
        # the token ids, by position or by keyword (ModernBERT's decoder)
        x = args[0] if args else kwargs.get("input_ids")
        if self.call.took_hidden:
            raise PartitionError(
                f"{self.path} runs before the blocks, so stage 0 holds it, but the "
                f"model's forward used it after them too; {BY_HAND}"
            )
        if self.dim is not None:
            return torch.zeros(*x.shape, self.dim, dtype=self.call.dtype, device=x.device)
        return shaped_zeros(self.real[0], args, kwargs, x.device, self.call.dtype)


class _Head(nn.Module):
    """A module of the last stage, on an earlier one: the forward stops before reaching it."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: object, **kwargs: object) -> None:  # noqa: D102
        raise PartitionError(
            f"{self.path} runs after the blocks, so the last stage holds it, but the "
            f"model's forward used it before them too; {BY_HAND}"
        )


class _PassThrough(_StandIn):
    """A block of an earlier stage: its input goes on unchanged (as `(hidden, None, ...)`
    where the family's blocks return a tuple of `items`; 0: not a tuple)."""

    def __init__(self, block: nn.Module, items: int) -> None:
        super().__init__()
        self.stood_for, self.items = [block], items

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor | tuple:  # noqa: D102
        return _tuple_of(_hidden_of(args, kwargs), self.items)


class _Received(_StandIn):
    """The last block, for a stage holding only the head: yields the received hidden state
    (in a tuple of `items` where the family's blocks return one)."""

    def __init__(self, block: nn.Module, call: _Call, items: int) -> None:
        super().__init__()
        self.stood_for, self.call, self.items = [block], call, items

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor | tuple:  # noqa: D102
        self.call.took_hidden = True
        return _tuple_of(self.call.hidden, self.items)


class _Edge(_StandIn):
    """The stage's first block on a later stage (it runs on the received hidden state) or
    its last on an earlier one (the forward stops with the block's output), or both."""

    def __init__(self, block: nn.Module, call: _Call, takes_hidden: bool, stops: bool) -> None:
        super().__init__()
        self.block = [block]  # a list: the block is the stage's own, not this stand-in's
        self.stood_for = self.block
        self.call, self.takes_hidden, self.stops = call, takes_hidden, stops

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:  # noqa: D102
        if self.takes_hidden:
            self.call.took_hidden = True
            if args:
                args = (self.call.hidden, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": self.call.hidden}
        out = self.block[0](*args, **kwargs)
        if self.stops:
            raise _Stop(out[0] if isinstance(out, tuple) else out)
        return out


class _StopHere(_StandIn):
    """A block of a later stage, for a stage holding only the embeddings: the forward
    stops with this block's input."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.stood_for = [block]

    def forward(self, *args: object, **kwargs: object) -> None:  # noqa: D102
        raise _Stop(_hidden_of(args, kwargs))


class HFStage(StageModule):
    """Layers `first`.. of a HuggingFace causal LM, run through the model's own forward.

    Stage 0 takes (input_ids[, attention_mask[, position_ids]]); a later stage takes the
    previous stage's (hidden, *those); the last stage returns the logits.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], first: int) -> None:
        super().__init__(layers, first_layer=first)
        found = find(model)
        n = len(found.blocks)
        self.whole = _Whole(model, found)  # not a submodule: other stages' weights are not ours
        end = first + len(layers)  # layers [first, end) of [embeddings, blocks..., head]
        self.has_embeddings, self.has_head = first == 0, end == n + 2
        self._call = _Call()
        self._swaps: list[tuple[nn.Module, str, nn.Module]] = []
        if not self.has_embeddings and found.feeds_blocks and first <= n:
            raise PartitionError(
                f"{type(model).__name__}'s blocks take the output of "
                f"{', '.join(sorted(found.feeds_blocks))} besides the hidden state (as the "
                f"embeddings), which only stage 0 computes: a later stage's blocks would get "
                f"zeros. Train it with stages=1, or {BY_HAND}"
            )
        if not self.has_embeddings:
            for path, module in found.before.items():
                self._swap(model, path, _Embedding(path, module, self._call))
        if not self.has_head:
            for path in found.after:
                self._swap(model, path, _Head(path))
        for i, block in enumerate(found.blocks):
            layer, path = i + 1, f"{found.blocks_path}.{i}"
            if layer < first:
                last_before_head = layer == n and first == n + 1
                items = found.block_items if found.block_tuple else 0
                stand_in = (
                    _Received(block, self._call, items)
                    if last_before_head
                    else _PassThrough(block, items)
                )
                self._swap(model, path, stand_in)
            elif layer < end:
                takes_hidden = layer == first
                stops = layer == end - 1 and not self.has_head
                if takes_hidden or stops:
                    self._swap(model, path, _Edge(block, self._call, takes_hidden, stops))
            else:
                self._swap(model, path, _StopHere(block))

    @property
    def model(self) -> nn.Module:
        """The whole HuggingFace model whose forward this stage runs."""
        return self.whole.model

    def stream_layers(self) -> list[tuple[int, nn.Module]]:
        """The blocks, and in place of the embeddings' and head's `Ends` (never called: the
        model's forward runs their modules) those modules, so each draws from its layer's
        stream. The code a later stage runs before its first block (dropout on the zeros
        standing in for the embeddings) draws from a scratch stream, not its block's."""
        out = []
        for i, layer in enumerate(self):
            parts = list(layer.children()) if isinstance(layer, Ends) else [layer]
            out += [(self.first_layer + i, part) for part in parts]
        return out

    def _swap(self, model: nn.Module, path: str, stand_in: nn.Module) -> None:
        parent, _, name = path.rpartition(".")
        self._swaps.append((model.get_submodule(parent), name, stand_in))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:  # noqa: D102
        hidden, given = self._unpack(inputs)
        call = self._call
        call.hidden, call.took_hidden = hidden, False
        floats = (p.dtype for p in self.parameters() if p.is_floating_point())
        call.dtype = next(floats, torch.float32)
        self._everywhere_on(given[0].device)
        kwargs = dict(zip(INPUTS, given))
        try:
            with self._standing_in():
                out = self.model(**kwargs, use_cache=False)
        except _Stop as stop:
            return (stop.hidden, *given)
        finally:
            call.hidden = None
        if not self.has_head:
            raise PartitionError(
                f"the forward of {type(self.model).__name__} ended without reaching the "
                f"blocks after this stage's; {BY_HAND}"
            )
        if hidden is not None and not call.took_hidden:
            raise PartitionError(
                f"the forward of {type(self.model).__name__} never ran this stage's first "
                f"layer ({self.first_layer}) on the hidden state it received; {BY_HAND}"
            )
        if getattr(out, "aux_loss", None) is not None:  # switched on after wrapping
            raise PartitionError(f"{type(self.model).__name__} returned an aux_loss; {AUX_LOSS}")
        return out.logits

    def _unpack(
        self, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """(received hidden state or None, the inputs stage 0 was given)."""
        hidden = None
        if not self.has_embeddings:
            if not inputs or not inputs[0].is_floating_point():
                raise MyelinError(
                    f"stage holding layers from {self.first_layer} of a HuggingFace model "
                    f"takes (hidden, input_ids, ...), got {_describe(inputs)}"
                )
            hidden, inputs = inputs[0], inputs[1:]
        if not 1 <= len(inputs) <= len(INPUTS) or inputs[0].is_floating_point():
            raise MyelinError(
                f"a HuggingFace causal LM takes input_ids, (input_ids, attention_mask) or "
                f"(input_ids, attention_mask, position_ids), integer tensors of shape "
                f"(batch, tokens); got {_describe(inputs)}"
            )
        return hidden, inputs

    def _standing_in(self) -> contextlib.AbstractContextManager[None]:
        """Stand-ins in the model for what this stage does not hold, for one forward."""
        return swapped(self._swaps)

    def _everywhere_on(self, device: torch.device) -> None:
        """The stateless modules every stage runs (rotary tables) materialised on `device`."""
        for module in self.whole.found.everywhere.values():
            buffers = list(module.buffers())
            if not buffers or buffers[0].device == device and not buffers[0].is_meta:
                continue
            if any(b.is_meta for b in buffers):  # built under init_empty: derive them again
                module.to_empty(device=device)
                for sub in module.modules():
                    self.model._init_weights(sub)
            else:
                module.to(device)

    def train(self, mode: bool = True) -> HFStage:
        """Train or eval mode for the whole model: its forward reads modules outside ours."""
        self.model.train(mode)
        return super().train(mode)


@dataclass(frozen=True, slots=True)
class _Whole:
    model: nn.Module
    found: Found


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    """A block's hidden-state input: its first argument, or `hidden_states=`."""
    return args[0] if args else kwargs["hidden_states"]


def _describe(inputs: tuple[torch.Tensor, ...]) -> str:
    if not inputs:
        return "nothing"
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in inputs)
