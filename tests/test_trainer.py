"""The Trainer in one process: exact equivalence, input splitting and configuration errors."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import myelin
from myelin import ConfigError, PartitionError, Trainer, TransportConfig
from myelin.microbatch import uneven_rows
from myelin.models import GPT, GPTConfig, lm_loss
from myelin.trainer import split_batch

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def accumulate(model, opt, pieces, loss_fn):
    """Plain PyTorch: gradient accumulation over microbatches, then one optimizer step."""
    total = 0.0
    for x, y in pieces:
        loss = loss_fn(model(x), y)
        (loss / len(pieces)).backward()
        total += loss.item()
    opt.step()
    opt.zero_grad()
    return total / len(pieces)


def test_one_stage_is_bit_identical_to_gradient_accumulation():
    model = mlp()
    ref = copy.deepcopy(model)
    ref_opt = ADAMW(ref.parameters())
    with Trainer(model, ADAMW, F.cross_entropy, microbatches=4) as trainer:
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            loss = trainer.step(x, y)
            assert loss == accumulate(
                ref, ref_opt, list(zip(x.chunk(4), y.chunk(4))), F.cross_entropy
            )
        for a, b in zip(trainer.module.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b)
        assert (trainer.rank, trainer.stage, trainer.replica, trainer.world_size) == (0, 0, 0, 1)


def test_lists_of_microbatches_with_different_lengths():
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    ref_opt = ADAMW(ref.parameters())
    trainer = Trainer(model, ADAMW, lm_loss, microbatches=3)
    for _ in range(3):
        seqs = [torch.randint(0, 32, (2, t + 1)) for t in (5, 12, 16)]
        xs, ys = [s[:, :-1] for s in seqs], [s[:, 1:] for s in seqs]
        loss = trainer.step(xs, ys)
        assert loss == accumulate(ref, ref_opt, list(zip(xs, ys)), lm_loss)
    trainer.close()
    trainer.close()  # twice is fine
    with pytest.raises(myelin.MyelinError, match="closed"):
        trainer.step(xs, ys)


def test_tuple_inputs_reach_the_model_as_arguments():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, mask):
            return self.lin(x * mask)

    torch.manual_seed(0)
    trainer = Trainer(nn.Sequential(Masked()), ADAMW, F.cross_entropy, microbatches=2)
    x, mask, y = torch.randn(4, 4), torch.ones(4, 4), torch.tensor([0, 1, 0, 1])
    assert trainer.step((x, mask), y) > 0
    trainer.close()


def test_eval_step_leaves_each_modules_mode_as_it_was():
    """A frozen BatchNorm (eval mode inside a model that trains, as in fine-tuning) stays
    frozen after an evaluation: eval_step put every module back in train mode, and the
    next steps updated its running statistics, unlike plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    model[1].eval()
    ref = copy.deepcopy(model)
    ref_opt = ADAMW(ref.parameters())
    modes = [m.training for m in model.modules()]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    with Trainer(model, ADAMW, F.cross_entropy, microbatches=2) as trainer:
        trainer.eval_step(x, y)
        assert [m.training for m in model.modules()] == modes
        loss = trainer.step(x, y)
    assert loss == accumulate(ref, ref_opt, list(zip(x.chunk(2), y.chunk(2))), F.cross_entropy)
    assert torch.equal(model[1].running_mean, ref[1].running_mean)  # not updated by steps


def test_split_batch_shapes_and_errors():
    parts = split_batch(torch.arange(8), 4, "inputs")
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    pairs = split_batch((torch.zeros(4, 2), torch.ones(4)), 2, "inputs")
    assert len(pairs) == 2 and pairs[1][0].shape == (2, 2) and pairs[1][1].shape == (2,)
    assert split_batch(None, 4, "inputs") is None
    uneven = split_batch(torch.arange(10), 4, "inputs")  # a short last batch, say
    assert [p.tolist() for p in uneven] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert uneven_rows(torch.arange(10), 4) == [3, 3, 2, 2]
    assert uneven_rows(torch.arange(8), 4) is None and uneven_rows([1] * 4, 4) is None
    with pytest.raises(
        ConfigError, match="inputs: a batch of 3 rows cannot be split into microbatches=4"
    ):
        split_batch(torch.zeros(3, 3), 4, "inputs")
    with pytest.raises(ConfigError, match="targets: a list is taken as one entry per microbatch"):
        split_batch([torch.zeros(1)] * 3, 4, "targets")
    with pytest.raises(ConfigError, match=r"inputs\[1\] has batch size 3, but inputs\[0\] has 4"):
        split_batch((torch.zeros(4), torch.zeros(3)), 2, "inputs")
    with pytest.raises(ConfigError, match="0-d"):
        split_batch(torch.tensor(1.0), 1, "inputs")
    with pytest.raises(ConfigError, match="inputs is an empty tuple"):
        split_batch((), 1, "inputs")


def test_max_inflight_is_refused_for_a_fixed_schedule():
    from myelin.config import PipelineConfig

    assert PipelineConfig(schedule="zero-bubble", max_inflight=1).max_inflight == 1
    for schedule in ("gpipe", "1f1b"):  # (it was taken and ignored)
        with pytest.raises(ConfigError, match=f"schedule='{schedule}' is a fixed order"):
            PipelineConfig(schedule=schedule, max_inflight=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stages": 0}, "stages=0 must be an int >= 1"),
        ({"stages": 1.5}, "stages=1.5 must be an int >= 1"),
        ({"microbatches": -1}, "microbatches=-1 must be an int >= 1"),
        ({"data_parallel": True}, "data_parallel=True must be an int >= 1"),
        (
            {"schedule": "zigzag"},
            "schedule='zigzag' must be one of message-driven, gpipe, 1f1b, zero-bubble",
        ),
        ({"max_inflight": 0}, "max_inflight=0 must be an int >= 1"),
        ({"partition": [1, 1]}, r"partition=\[1, 1\] lists 2 stages, but stages=1"),
        ({"partition": [0]}, "each entry must be an int >= 1"),
        ({"timeout": 0}, r"timeout=0 must be in \(0, 86400\] seconds"),
        ({"timeout": "soon"}, "timeout='soon' must be a number of seconds"),
        ({"transport": "ipc"}, "transport='ipc' must be a myelin.TransportConfig"),
    ],
)
def test_bad_settings_are_rejected_naming_the_setting(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(mlp(), ADAMW, F.cross_entropy, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "udp"}, "TransportConfig.kind='udp' must be one of"),
        ({"host": ""}, "TransportConfig.host=''"),
        ({"max_inflight_bytes": 0}, "TransportConfig.max_inflight_bytes=0"),
        ({"linger_ms": -1}, "TransportConfig.linger_ms=-1"),
    ],
)
def test_bad_transport_settings_are_rejected(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TransportConfig(**kwargs)


def test_optimizer_must_be_a_factory():
    model = mlp()
    with pytest.raises(ConfigError, match="functools.partial"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    with pytest.raises(ConfigError, match="loss_fn=3 must be callable"):
        Trainer(model, ADAMW, 3)


def test_impossible_split_fails_before_any_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        Trainer(mlp(), ADAMW, F.cross_entropy, stages=4)
    assert not torch.distributed.is_initialized()


def test_multi_stage_run_started_alone_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"needs 2 processes.*myelin run -n 2"):
        Trainer(mlp(), ADAMW, F.cross_entropy, stages=2)


def test_world_size_must_be_stages_times_replicas(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="needs a world of 4 processes, but WORLD_SIZE says 3"):
        Trainer(mlp(), ADAMW, F.cross_entropy, stages=2, data_parallel=2)
    assert not torch.distributed.is_initialized()


def test_loss_fn_must_return_a_scalar():
    trainer = Trainer(mlp(), ADAMW, lambda out, y: out, microbatches=1)
    with pytest.raises(myelin.MyelinError, match=r"scalar tensor, got \(4, 4\)"):
        trainer.step(torch.randn(4, 8), torch.zeros(4))
    with pytest.raises(myelin.MyelinError, match=r"scalar tensor, got \(4, 4\)"):
        trainer.step(torch.randn(4, 8), torch.zeros(4))  # one rank: the step was forgotten
    trainer.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_close_takes_every_hook_off_the_users_model(precision):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    t = myelin.Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        nn.functional.cross_entropy,
        microbatches=2,
        precision=precision,
    )
    t.step(torch.randn(4, 6), torch.randint(0, 3, (4,)))
    t.close()
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, name
    for name, p in model.named_parameters():
        assert not p._post_accumulate_grad_hooks and not p._backward_hooks, name
    copy.deepcopy(model)  # a model with a closed trainer's hooks could not be copied
    x = torch.randn(4, 6, dtype=next(model.parameters()).dtype)
    model(x).sum().backward()  # the user's own backward keeps its gradients
    assert all(p.grad is not None for p in model.parameters())


def test_a_plain_list_of_modules_trains_in_one_process():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)]
    with Trainer(layers, functools.partial(torch.optim.SGD, lr=0.1), F.cross_entropy) as t:
        t.step(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))
        state = t.state_dict()
    nn.Sequential(*[nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)]).load_state_dict(state)
    assert torch.equal(state["0.weight"], layers[0].weight)
