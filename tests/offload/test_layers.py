"""Layers of a stage, found from the module however it was given, and the window of pages
backward wants on the device around where it is.

Run: python -m pytest -q tests/offload/test_layers.py
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import myelin
from myelin.models import GPT, GPTConfig
from myelin.offload.layers import Ahead, find_layers
from myelin.partition import StageModule, stage_module

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, d_model=16)


class Named(nn.Module):
    """Layers as attributes, no container."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.third = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(self.second(self.first(x)))


class Wrapper(nn.Module):
    """One child holding the model: the search goes down to its blocks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_gpt_given_as_one_module_pages_by_its_blocks():
    model = GPT(TINY)
    assert find_layers(model) == list(model.blocks)
    assert find_layers(Wrapper(model)) == list(model.blocks)


def test_a_pipeline_stage_pages_by_its_layers():
    model = GPT(TINY)
    stage = stage_module(model, 2, 1)
    assert isinstance(stage, StageModule)
    assert find_layers(stage) == list(stage)  # blocks and the head, not the MLP's parts
    seq = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    assert find_layers(seq) == list(seq)


def test_other_models_given_as_one_module():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    assert find_layers(encoder) == list(encoder.layers)
    named = Named()
    assert find_layers(named) == [named.first, named.second, named.third]
    assert find_layers(nn.Linear(4, 4)) == []  # one layer: nothing to split


def test_hf_gpt2_as_one_module_pages_by_its_blocks():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=8, vocab_size=32)
    model = transformers.GPT2LMHeadModel(cfg)
    assert find_layers(model) == list(model.transformer.h)


# -- the window -----------------------------------------------------------------------------


@dataclass
class P:
    layer: int
    nbytes: int


# Three layers of 4 pages of 10 bytes, then a head of two pages of 30.
PAGES = [P(layer, 10) for layer in range(3) for _ in range(4)] + [P(3, 30), P(3, 30)]
LAYER_BYTES = [40, 40, 40, 60]


def test_one_layer_ahead_slides_page_by_page():
    ahead = Ahead(layers=1)
    # In the head (layer 3), the window is the bytes of layer 2: its 4 pages.
    assert ahead.lowest(PAGES, 13, LAYER_BYTES) == 11  # the other head page, 1 of layer 2
    assert ahead.lowest(PAGES, 12, LAYER_BYTES) == 8
    # In layer 2 at its last page: the 40 bytes below it.
    assert ahead.lowest(PAGES, 11, LAYER_BYTES) == 7
    assert ahead.lowest(PAGES, 8, LAYER_BYTES) == 4
    # In the first layer, the window is that layer's own bytes.
    assert ahead.lowest(PAGES, 3, LAYER_BYTES) == 0


def test_more_layers_ahead_and_none():
    assert Ahead(layers=2).lowest(PAGES, 11, LAYER_BYTES) == 3  # 80 bytes below
    assert Ahead(layers=0).lowest(PAGES, 11, LAYER_BYTES) == 11  # only what is needed now


def test_the_window_skips_layers_left_without_pages():
    # Linear, Tanh, Linear, ...: each Tanh output is saved again by the next Linear, whose
    # layer takes its page, so every other layer ends empty
    layer_bytes = [40, 0, 40, 0, 40, 0, 40]
    assert Ahead(layers=1).window(layer_bytes, 6) == 40  # was 0: nothing came back early
    assert Ahead(layers=2).window(layer_bytes, 6) == 80
    assert Ahead(layers=0).window(layer_bytes, 6) == 0
    assert Ahead(layers=1).window([0, 0, 30], 2) == 0  # nothing below holds pages


def test_a_flat_sequential_brings_pages_back_ahead_as_its_blocks_do():
    def run(flat: bool) -> dict:
        torch.manual_seed(0)
        pairs = [(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]
        if flat:
            model = nn.Sequential(*[m for pair in pairs for m in pair])
        else:
            model = nn.Sequential(*[nn.Sequential(*pair) for pair in pairs])
        offload = myelin.OffloadConfig(activations=True, min_bytes=1024)
        opt = functools.partial(torch.optim.SGD, lr=1e-3)
        with myelin.Trainer(model, opt, nn.functional.mse_loss, microbatches=2,
                            offload=offload) as t:  # fmt: skip
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
            for _ in range(2):
                t.step(x, x)
            return t.memory_stats()

    flat, blocks = run(True), run(False)
    assert blocks["prefetch_hits"] > 0 and blocks["prefetch_misses"] == 0
    assert (flat["prefetch_hits"], flat["prefetch_misses"]) == (
        blocks["prefetch_hits"],
        blocks["prefetch_misses"],
    )


def test_bytes_ahead_keep_at_least_one_page():
    assert Ahead(nbytes=25).lowest(PAGES, 11, LAYER_BYTES) == 9
    assert Ahead(nbytes=1).lowest(PAGES, 13, LAYER_BYTES) == 12  # a 30-byte page all the same
    assert Ahead(nbytes=1000).lowest(PAGES, 13, LAYER_BYTES) == 0


@pytest.mark.parametrize(
    "ahead", [Ahead(), Ahead(layers=0), Ahead(layers=2), Ahead(nbytes=1), Ahead(nbytes=45)]
)
def test_reach_answers_as_lowest_at_every_page(ahead):
    """The store asks `Reach` (prefix sums, summed once per forward) at each page backward
    reaches; it must pick what `lowest` picks, zero-byte pages and uneven layers included."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        counts = torch.randint(0, 5, (5,), generator=gen).tolist()
        pages = [
            P(layer, int(torch.randint(0, 40, (), generator=gen)))
            for layer, count in enumerate(counts)
            for _ in range(count)
        ]
        layer_bytes = [sum(p.nbytes for p in pages if p.layer == i) for i in range(len(counts))]
        reach = ahead.reach(pages, layer_bytes)
        got = [reach.lowest(pos) for pos in range(len(pages))]
        assert got == [ahead.lowest(pages, pos, layer_bytes) for pos in range(len(pages))]
    fixed = Ahead(layers=1).reach(PAGES, LAYER_BYTES)
    assert [fixed.lowest(pos) for pos in (13, 12, 11, 8, 3)] == [11, 8, 7, 4, 0]
