"""Where a HuggingFace model's forward uses each module, found by one forward of stand-ins.

Registration order does not always say it: OPT registers its final norm and output
projection before its blocks and runs them after. `probe` runs the model's own forward on
two tokens with every module beside the path to the blocks (and every block) replaced by
a stand-in that records the call and returns zeros shaped as the module's output, computed
on the meta device (`shaped_zeros`): no weight is read, so a model built under
`init_empty` is probed as cheaply as a real one. It also finds whether a block returns a
tuple (Falcon's, Bloom's: the model takes `outputs[0]`), which a stage's stand-ins for
blocks it does not hold must return too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["Probed", "probe", "shaped_zeros", "swapped"]

Side = Literal["before", "after", "between"]


def shaped_zeros(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> Any:
    """What `module(*args, **kwargs)` returns, as zeros on `device`: the module run on the
    meta device, its own tensors untouched (its floating ones taken as `dtype` if given)."""
    on_meta = {
        name: torch.empty_like(
            t, device="meta", dtype=dtype if dtype and t.is_floating_point() else t.dtype
        )
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    }
    meta = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, (args, kwargs))
    with torch.no_grad():
        out = torch.func.functional_call(module, on_meta, meta[0], meta[1], strict=False)
    return tree_map(
        lambda x: (
            torch.zeros(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) else x
        ),
        out,
    )


class _Recorder(nn.Module):
    """Records that `path` was called and returns zeros shaped as its output (a later
    block: what the first block returned, so the blocks run on the meta device once)."""

    def __init__(
        self, path: str, real: nn.Module, calls: list[str], like: _Recorder | None = None
    ) -> None:
        super().__init__()
        self.path, self.real, self.calls = path, [real], calls
        self.like = [like]  # a later block: returns what the first returned (run once)
        self.returned: Any = None
        self.extra: list[torch.Tensor] = [] if like is None else like.extra  # the blocks'

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        self.calls.append(self.path)
        if self.path == "<block>":  # what it takes besides the hidden state
            rest = [*args[1:], *(v for k, v in kwargs.items() if k != "hidden_states")]
            if not args:
                rest = [v for k, v in kwargs.items() if k != "hidden_states"]
            self.extra.extend(_tensors(rest))
        like = self.like[0]
        if like is not None and like.returned is not None:
            return like.returned
        self.returned = shaped_zeros(self.real[0], args, kwargs, torch.device("cpu"))
        if self.path != "<block>" and any(True for _ in self.real[0].parameters()):
            # a value nothing else has, so a copy of it passed to the blocks is recognised
            tree_map(lambda x: x.fill_(_MARK) if _floating(x) else x, self.returned)
        return self.returned


@dataclass(frozen=True, slots=True)
class Probed:
    """What one forward of stand-ins found."""

    sides: dict[str, Side]  # each module the forward called: before, after or between
    block_tuple: bool  # a block returns a tuple whose first item is the hidden state
    feeds_blocks: frozenset[str] = frozenset()  # modules whose output the blocks take
    # besides the hidden state (Zamba's blocks take the embeddings too)
    block_items: int = 1  # how many items a block's tuple holds (RWKV's: hidden, state, ...)


def probe(
    model: nn.Module, blocks_path: str, blocks: nn.ModuleList, beside: dict[str, nn.Module]
) -> Probed | None:
    """For each module of `beside` the forward calls: whether it runs before the blocks,
    after them, or "between" (among them, or on both sides); and what a block returns.
    None if the probe cannot run (the caller then keeps registration order)."""
    calls: list[str] = []
    swaps = {path: _Recorder(path, m, calls) for path, m in beside.items()}
    first_block = _Recorder("<block>", blocks[0], calls)
    swaps.update(
        {
            f"{blocks_path}.{i}": first_block
            if i == 0
            else _Recorder("<block>", b, calls, first_block)
            for i, b in enumerate(blocks)
        }
    )
    ids = torch.zeros(1, 2, dtype=torch.long)
    try:
        with swapped((*_at(model, p), m) for p, m in swaps.items()), torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception:  # noqa: BLE001 (a family the probe cannot run: registration order)
        return None
    if "<block>" not in calls:
        return None
    first, last = calls.index("<block>"), len(calls) - 1 - calls[::-1].index("<block>")
    found: dict[str, Side] = {}
    for i, path in enumerate(calls):
        if path != "<block>":
            side = "before" if i < first else "after" if i > last else "between"
            found[path] = side if found.get(path, side) == side else "between"
    marked = [t for t in first_block.extra if _floating(t) and bool((t == _MARK).all())]
    feeds = frozenset(
        path
        for path, rec in swaps.items()
        if rec.path != "<block>"
        and any(_floating(t) and t.shape == m.shape for t in _tensors(rec.returned) for m in marked)
    )
    returned = first_block.returned
    items = len(returned) if isinstance(returned, tuple) else 1
    return Probed(found, isinstance(returned, tuple), feeds, items)


_MARK = 0.6180339887  # what the probe's stand-ins for stateful modules return


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` (through tuples, lists and dicts)."""
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else x, value)
    return found


@contextlib.contextmanager
def swapped(swaps: Iterable[tuple[nn.Module, str, nn.Module]]) -> Iterator[None]:
    """Each (parent, name, stand-in): the stand-in in the parent's child `name` for the
    length of the block, the real child put back after it whatever happens."""
    done = []
    try:
        for parent, name, stand_in in swaps:
            done.append((parent, name, parent._modules[name]))
            parent._modules[name] = stand_in
        yield
    finally:
        for parent, name, real in reversed(done):
            parent._modules[name] = real


def _at(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return model.get_submodule(parent), name
