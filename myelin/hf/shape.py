"""Where a HuggingFace model's pipeline layers are, found from its structure, not its class.

    found = find(model)   # the blocks; the modules before them, after them, and everywhere

The blocks are the one `ModuleList` whose children all belong to the classes the model
names in `_no_split_modules` (the modules HuggingFace never cuts; Accelerate's device maps
rely on the same list). Along the path from the model down to that list, modules that hold
state and that the model's forward runs before the blocks (token and position embeddings)
open the pipeline; those it runs after them (final norm, LM head) close it: one forward
of stand-ins finds which (probe.py; registration order where it cannot run). Stateless
ones (rotary tables, dropout) belong to no layer and run on every stage. A family that is
not named anywhere in myelin works when it has this shape.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from myelin.errors import PartitionError
from myelin.hf.probe import Probed, probe

__all__ = ["AUX_LOSS", "BY_HAND", "Found", "find", "is_hf_model"]

BY_HAND = (
    "to pipeline a model of another shape, pass its layers by hand: an nn.Sequential or a "
    "list of modules (each taking the previous one's outputs), or give the model a "
    "pipeline_layers() method that returns them in order"
)
AUX_LOSS = (
    "its loss would add the routers' auxiliary (load-balancing) loss, which myelin does not "
    "carry between stages (each holds only its own routers' logits) and would drop without a "
    "word; set model.config.output_router_logits = False to train on the language-model loss"
)


def is_hf_model(model: Any) -> bool:
    """Whether `model` is a HuggingFace `PreTrainedModel` (never imports transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


@dataclass(frozen=True, slots=True)
class Found:
    """A model's pipeline shape; module paths are as in `model.named_modules()`."""

    blocks_path: str  # "model.layers"
    blocks: nn.ModuleList
    before: dict[str, nn.Module]  # stateful modules run before the blocks
    after: dict[str, nn.Module]  # stateful modules run after them
    everywhere: dict[str, nn.Module]  # stateless modules along the path: every stage runs them
    block_tuple: bool = False  # a block returns (hidden, ...), not the hidden state alone
    feeds_blocks: frozenset[str] = frozenset()  # before-modules whose output blocks take too
    block_items: int = 1  # the items of a block's tuple (the hidden state first)


def _check_causal(model: nn.Module, name: str) -> None:
    """Only a causal LM: a masked LM (or another head) brings a loss myelin would count as a
    causal one, and an encoder run without is_decoder=True attends to later tokens."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        raise PartitionError(
            f"{name} is not a causal LM (its HuggingFace loss is {loss_type}); myelin "
            f"pipelines decoder-only causal LMs (*ForCausalLM) by themselves; {BY_HAND}"
        )
    is_decoder = getattr(getattr(model, "config", None), "is_decoder", None)
    if is_decoder is False and loss_type != "ForCausalLM":  # (GPT-NeoX's says False)
        raise PartitionError(
            f"{name} has is_decoder=False: an encoder's attention sees later tokens, so it "
            f"is no causal LM; build it with is_decoder=True, or {BY_HAND}"
        )


def find(model: nn.Module) -> Found:
    """The blocks of a decoder-only HF model and what comes before and after them, or a
    PartitionError that says what was not found and how to pass layers by hand."""
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise PartitionError(
            f"{name} is an encoder-decoder model; myelin pipelines decoder-only HuggingFace "
            f"models (one list of blocks) by themselves; {BY_HAND}"
        )
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise PartitionError(f"{name} has output_router_logits=True; {AUX_LOSS}")
    _check_causal(model, name)
    keep_whole = set(getattr(model, "_no_split_modules", None) or ())
    if not keep_whole:
        raise PartitionError(
            f"cannot find the blocks of a {name}: it names no block class in "
            f"`_no_split_modules`; {BY_HAND}"
        )
    lists = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(type(child).__name__ in keep_whole for child in module)
    ]
    if len(lists) != 1:
        found = f"found {len(lists)}: {[p for p, _ in lists]}" if lists else "found none"
        raise PartitionError(
            f"cannot find the blocks of a {name}: expected one ModuleList of "
            f"{sorted(keep_whole)} (its `_no_split_modules`), {found}; {BY_HAND}"
        )
    blocks_path, blocks = lists[0]
    beside, registered = _beside(model, blocks_path)
    probed = probe(model, blocks_path, blocks, beside)
    before, after, everywhere = _around(model, beside, registered, probed)
    _check_ends(model, before, after)
    block_tuple = probed is not None and probed.block_tuple
    feeds = frozenset(p for p in probed.feeds_blocks if p in before) if probed else frozenset()
    items = probed.block_items if probed is not None else 1
    return Found(blocks_path, blocks, before, after, everywhere, block_tuple, feeds, items)


def _beside(model: nn.Module, blocks_path: str) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """The modules beside the path from `model` down to the blocks, and the side of the
    path each is registered on ("before" or "after")."""
    registered: dict[str, str] = {}
    beside: dict[str, nn.Module] = {}
    node, prefix = model, ""
    for part in blocks_path.split("."):
        own = [n for n, p in node.named_parameters(recurse=False)]
        own += [n for n in node.state_dict(keep_vars=True) if "." not in n and n not in own]
        if own:
            raise PartitionError(
                f"{type(model).__name__}: {prefix}{own[0]} is held by "
                f"{type(node).__name__} itself, outside any module before or after the "
                f"blocks; {BY_HAND}"
            )
        side = "before"
        for child_name, child in node.named_children():
            if child_name == part:
                side = "after"
                continue
            beside[prefix + child_name] = child
            registered[prefix + child_name] = side
        node, prefix = getattr(node, part), f"{prefix}{part}."
    return beside, registered


def _around(
    model: nn.Module,
    beside: dict[str, nn.Module],
    registered: dict[str, str],
    probed: Probed | None,
) -> tuple[dict, dict, dict]:
    """The modules beside the blocks sorted by whether they hold state and run before or
    after the blocks: where the model's forward calls them (`probed`), or where they are
    registered if the probe could not run or never called them."""
    used = probed.sides if probed is not None else {}
    before: dict[str, nn.Module] = {}
    after: dict[str, nn.Module] = {}
    everywhere: dict[str, nn.Module] = {}
    for path, child in beside.items():
        if not child.state_dict():
            everywhere[path] = child
            continue
        side = used.get(path, registered[path])
        if side == "between":
            raise PartitionError(
                f"{type(model).__name__}: the forward uses {path}, which holds weights, "
                f"among its blocks or on both sides of them, so no stage can hold it; "
                f"{BY_HAND}"
            )
        (before if side == "before" else after)[path] = child
    return before, after, everywhere


def _check_ends(model: nn.Module, before: dict, after: dict) -> None:
    """The input embedding opens the pipeline and the LM head closes it."""
    name = type(model).__name__
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        raise PartitionError(
            f"{name} has no LM head (get_output_embeddings() is None); myelin pipelines "
            f"HuggingFace causal LMs (*ForCausalLM); {BY_HAND}"
        )
    for what, module, side, where in (
        ("input embedding", embedding, before, "before"),
        ("LM head", head, after, "after"),
    ):
        if not any(module is m or _contains(m, module) for m in side.values()):
            raise PartitionError(
                f"{name}: its {what} ({type(module).__name__}) does not run {where} "
                f"the blocks; {BY_HAND}"
            )


def _contains(parent: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in parent.modules())
