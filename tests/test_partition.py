"""Splitting models into contiguous stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from myelin import PartitionError, StageModule, balance, split
from myelin.models import GPT, GPTConfig
from myelin.partition import layers_of, stage_module


def test_balance_follows_parameter_counts():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([10, 1, 1, 10], 2) == [2, 2]
    assert balance([30, 10, 10, 10], 2) == [1, 3]
    assert balance([5] * 8, 4) == [2, 2, 2, 2]
    assert sum(balance([3, 1, 4, 1, 5, 9, 2, 6], 3)) == 8


def test_every_stage_gets_a_layer_even_when_one_layer_dominates():
    assert balance([1000, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert balance([1, 1, 1, 1000], 2) == [3, 1]


def test_mlp_split_keeps_activations_with_their_linear():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    parts = split(model, 2)
    assert [len(p) for p in parts] == [2, 2]
    assert parts[0][0] is model[0] and parts[1][1] is model[3]


def test_explicit_partition_and_its_errors():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    assert [len(p) for p in split(model, 2, [1, 4])] == [1, 4]
    with pytest.raises(PartitionError, match=r"covers 4 layers, but the model has 5"):
        split(model, 2, [1, 3])
    with pytest.raises(PartitionError, match=r"lists 3 stages, but stages=2"):
        split(model, 2, [1, 2, 2])
    with pytest.raises(PartitionError, match=r"int >= 1"):
        split(model, 2, [0, 5])


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(PartitionError, match="cannot split 2 layers into 3 stages"):
        split(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 3)


def test_unsplittable_module_says_how_to_make_it_splittable():
    with pytest.raises(PartitionError, match="pipeline_layers"):
        split(nn.Linear(2, 2), 2)
    with pytest.raises(PartitionError, match="layer 1 is a str"):
        layers_of([nn.Linear(2, 2), "relu"])


def test_gpt_splits_into_embedding_blocks_head():
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, d_model=16))
    layers = layers_of(model)
    assert len(layers) == 6 and layers[0] is model.embed and layers[-1] is model.head
    idx = torch.randint(0, 32, (2, 8))
    stages = [stage_module(model, 3, i) for i in range(3)]
    x = idx
    for s in stages:
        x = s(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)
    assert [s.first_layer for s in stages] == [0, len(stages[0]), len(stages[0]) + len(stages[1])]


def test_stage_module_passes_tuples_on_as_arguments():
    class Two(nn.Module):
        def forward(self, x):
            return x, x * 2

    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    out = StageModule([Two(), Add()])(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0))


def test_one_stage_runs_the_models_own_forward():
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=1, d_model=8))
    assert stage_module(model, 1, 0) is model
    with pytest.raises(PartitionError, match="stage index 2 is out of range of 2"):
        stage_module(model, 2, 2)


class _HoldsState(nn.Module):
    """Layers [inp, Tanh, out], and a parameter and buffers of its own besides."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.temperature = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("mask", torch.ones(16))
        self.register_buffer("scratch", torch.ones(16), persistent=False)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.inp, nn.Tanh(), self.out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) * self.temperature


def test_state_held_outside_every_layer_is_named_not_dropped():
    """Stages run only the layers, so a parameter or saved buffer of the model itself would
    be neither trained nor in state_dict(); one stage runs the model's forward and keeps it."""
    model = _HoldsState()
    with pytest.raises(PartitionError, match=r"holds temperature, mask outside every layer"):
        split(model, 2)
    assert stage_module(model, 1, 0) is model
    del model.temperature
    model.register_buffer("mask", torch.ones(16), persistent=False)
    assert [len(g) for g in split(model, 2)] == [1, 2]  # a buffer not saved is no loss


class _Extra(nn.Linear):
    """A layer with extra state (made anew by each state_dict() call)."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([1.0])

    def set_extra_state(self, state: torch.Tensor) -> None:
        pass


def test_extra_state_inside_a_layer_is_not_outside():
    model = nn.Sequential(_Extra(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert [len(g) for g in split(model, 2)] == [1, 2]
    holder = _HoldsState()
    del holder.temperature
    holder.register_buffer("mask", torch.ones(16), persistent=False)
    holder.inp = _Extra(8, 16)
    assert [len(g) for g in split(holder, 2)] == [1, 2]

    class Own(_HoldsState):  # the model's own extra state: outside every layer
        def get_extra_state(self) -> torch.Tensor:
            return torch.tensor([2.0])

        def set_extra_state(self, state: torch.Tensor) -> None:
            pass

    own = Own()
    del own.temperature
    own.register_buffer("mask", torch.ones(16), persistent=False)
    with pytest.raises(PartitionError, match=r"holds _extra_state outside every layer"):
        split(own, 2)
    assert len(split(own, 1)) == 1  # one stage runs the model's own forward


def test_a_stage_output_that_is_not_tensors_names_the_item():
    from myelin import MyelinError
    from myelin.runtime.stage import as_tuple

    x = torch.zeros(2)
    assert as_tuple([x, x]) == (x, x)
    with pytest.raises(MyelinError, match=r"got tuple whose item 1 is NoneType"):
        as_tuple((x, None))
    with pytest.raises(MyelinError, match=r"got dict$"):
        as_tuple({"x": x})
