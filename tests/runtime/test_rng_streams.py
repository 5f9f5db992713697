"""LayerStreams: several modules may start one layer's stream, and what a stage draws
before its first layer starts comes from a stream of its own, kept out of checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from myelin.runtime.rng import LayerStreams


class _Drop(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5, training=True)


def _run(streams: LayerStreams, layers: list[nn.Module], x: torch.Tensor, lead: bool) -> list:
    """One forward: a draw before the first layer (if `lead`), then each layer's."""
    outs = []
    with streams.scope():
        if lead:
            torch.rand(100)  # code before the first layer, as an HF stage's embedding dropout
        for layer in layers:
            outs.append(layer(x))
    return outs


def test_draws_before_the_first_layer_leave_the_layers_streams_alone():
    layers = [_Drop(), _Drop()]
    x = torch.ones(64)
    plain = LayerStreams(7, 0, list(enumerate(layers)), torch.device("cpu"))
    led = LayerStreams(7, 0, list(enumerate(layers)), torch.device("cpu"))
    for _ in range(3):
        a, b = _run(plain, layers, x, False), _run(led, layers, x, True)
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert set(led.state_dict()["streams"]) == {"0", "1"}  # the lead stream is not saved
    plain.close(), led.close()


def test_several_modules_start_one_layers_stream_which_is_kept_once():
    first, second, other = _Drop(), _Drop(), _Drop()
    streams = LayerStreams(7, 0, [(3, first), (3, second), (4, other)], torch.device("cpu"))
    assert streams.keys == [3, 4]
    x = torch.ones(64)
    with streams.scope():
        a, b = first(x), second(x)  # one stream: the second mask follows the first
    alone = LayerStreams(7, 0, [(3, first)], torch.device("cpu"))
    with alone.scope():
        a2, b2 = first(x), first(x)
    assert torch.equal(a, a2) and torch.equal(b, b2) and not torch.equal(a, b)
    mark = streams.mark()
    with streams.scope():
        c = first(x)
    streams.rewind(mark)
    with streams.scope():
        assert torch.equal(first(x), c)
    streams.close(), alone.close()


def test_a_module_at_two_positions_draws_from_each_positions_stream():
    """A block reused at positions 1 and 3 draws from stream 1 at its first call and stream 3
    at its second, as it does when the two positions sit on different stages."""
    a, b = _Drop(), _Drop()
    x = torch.ones(64)
    whole = LayerStreams(7, 0, [(0, a), (1, b), (3, b)], torch.device("cpu"))
    with whole.scope():
        a(x)
        got = [b(x), b(x)]
    whole.close()
    for key, out in zip((1, 3), got, strict=True):
        alone = LayerStreams(7, 0, [(key, b)], torch.device("cpu"))
        with alone.scope():
            assert torch.equal(b(x), out), key
        alone.close()
    assert not torch.equal(got[0], got[1])
