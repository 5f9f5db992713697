"""Where a stage's layers begin and end, and how far ahead of backward pages come back.

Backward runs a stage's layers in reverse order, so an `ActivationStore` that knows which
layer saved each tensor can bring back the layers just below the one backward computes
and keep the last layer's tensors on the device. The layers are found from the module
itself, whatever form it was given in:

- a stage of a pipeline (an `nn.Sequential` or `nn.ModuleList`) and any module that is
  itself such a container: its children;
- a module given as one (a GPT, a HuggingFace model, an `nn.TransformerEncoder`): the
  children of the first container of at least two modules found breadth first (its
  blocks: `GPT.blocks`, `transformer.h`, `encoder.layers`), else its own children.

What runs before the first layer (an embedding), between and after them (a head, the
loss) counts as layers of its own. A module with no children pages as one layer.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Ahead", "Reach", "find_layers"]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def find_layers(module: nn.Module) -> list[nn.Module]:
    """The sub-modules whose forwards start and end a layer of `module`, in order."""
    queue = deque([module])
    while queue:
        node = queue.popleft()
        children = list(node.children())
        if isinstance(node, _CONTAINERS) and len(children) >= 2:
            return children
        queue.extend(children)
    children = list(module.children())
    return children if len(children) >= 2 else []


@dataclass(frozen=True, slots=True)
class Ahead:
    """How much of what backward needs next is on the device ahead of it: below the page
    backward is at, as many pages as fit in the bytes of the `layers` layers below its
    layer (of its own layer, in the first), or in `nbytes` when that is set; at least
    one page unless `layers` is 0. The forward keeps as much on the device behind the
    page it saved last, so a backward that follows at once finds its first pages there.
    The window slides page by page, so the device holds about `layers` layers at a time
    whichever way the microbatch goes."""

    layers: int = 1
    nbytes: int | None = None

    def window(self, layer_bytes: Sequence[int], layer: int) -> int:
        """The bytes to have on the device below a page of `layer` (`layer_bytes`: the
        bytes of each layer's pages)."""
        if self.nbytes is not None:
            return self.nbytes
        if layer == 0:
            return layer_bytes[0] if self.layers else 0
        # the nearest `layers` layers below that hold pages: a layer can be left empty when
        # a later one saves its output again (Linear, Tanh, Linear: the Tanh output is the
        # second Linear's), and an empty window would bring nothing back early
        total = taken = 0
        for nbytes in reversed(layer_bytes[:layer]):
            if taken == self.layers:
                break
            if nbytes:
                total, taken = total + nbytes, taken + 1
        return total

    def lowest(self, pages: Sequence[Any], pos: int, layer_bytes: Sequence[int]) -> int:
        """The first index of what should be on the device while backward is at
        `pages[pos]`. `pages` have `.layer` and `.nbytes`, in the order the forward saved
        them last, which backward reverses."""
        budget = self.window(layer_bytes, pages[pos].layer)
        low, total = pos, 0
        while low > 0 and budget > 0:
            if low < pos and total + pages[low - 1].nbytes > budget:
                break
            low -= 1
            total += pages[low].nbytes
        return low

    def reach(self, pages: Sequence[Any], layer_bytes: Sequence[int]) -> Reach:
        """`lowest` for the pages of a finished forward, asked at each of them as backward
        goes: the windows and the running bytes are summed once, not at every page."""
        cum = [0]
        for page in pages:
            cum.append(cum[-1] + page.nbytes)
        windows = [self.window(layer_bytes, layer) for layer in range(len(layer_bytes))]
        return Reach(cum, [windows[page.layer] for page in pages])


@dataclass(frozen=True, slots=True)
class Reach:
    """`Ahead.lowest` over fixed pages (`Ahead.reach`). cum[i]: the bytes of pages[:i];
    windows[i]: the window below pages[i]."""

    cum: list[int]
    windows: list[int]

    def lowest(self, pos: int) -> int:
        """As `Ahead.lowest(pages, pos, layer_bytes)`: the first index whose pages up to
        `pos` (excluded) fit the window, and at least `pos - 1` while the window is not 0."""
        window = self.windows[pos]
        if window <= 0 or pos == 0:
            return pos
        cum = self.cum
        return min(pos - 1, bisect_left(cum, cum[pos] - window, 0, pos))
