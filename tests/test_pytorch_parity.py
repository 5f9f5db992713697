"""Where a PyTorch user meets myelin in one process (issue 17): each test trains the same
model, data and optimizer with myelin and with plain PyTorch doing gradient accumulation
(tests/workers/_reference.py), and wants the same numbers. The multi-stage halves of these
items are in tests/test_parity_pipeline.py."""

from __future__ import annotations

import collections
import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import myelin
from myelin import ConfigError, OffloadConfig, Trainer
from tests.workers import _reference as reference
from tests.workers._reference import batches, mlp

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
HOST = OffloadConfig(optimizer=True, bucket_bytes=1024)  # several buckets even here
STREAM = OffloadConfig(optimizer="stream", bucket_bytes=1024)


def run(model, batches_, *, optimizer=ADAMW, microbatches=4, **kwargs):
    with Trainer(model, optimizer, F.cross_entropy, microbatches=microbatches, **kwargs) as t:
        losses = [t.step(x, y) for x, y in batches_]
        return losses, t.state_dict(), t


# -- 17.1: state_dict under half precision gives the fp32 masters -----------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("offload", [None, HOST], ids=["device", "host"])
def test_state_dict_under_half_precision_is_the_fp32_masters(precision, offload):
    data = batches(3)
    _, state, _ = run(mlp(), data, precision=precision, offload=offload)
    scale = 2.0**16 if precision == "fp16" else None
    model = mlp()
    _, masters, _ = reference.train(
        model, ADAMW, F.cross_entropy, data, 4, precision=precision, loss_scale=scale
    )
    names = [n for n, _ in model.named_parameters()]
    assert sorted(state) == sorted(model.state_dict())
    for name, master in zip(names, masters):
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], master), name
    # the masters are not half-precision numbers: the export is not the rounded weights
    assert any(not torch.equal(m, m.to(reference.DTYPES[precision]).float()) for m in masters)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_frozen_weight_comes_back_exact_under_half_precision(precision, tmp_path):
    """A frozen weight has no fp32 master: the stage holds it rounded, and state_dict(),
    checkpoints and a resume (in any precision) give the value it came in with."""
    model = mlp_frozen()  # 3.bias is exact in bf16 (and fp16): nothing kept for it
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    data = batches(3)
    want, masters, _ = reference.train(
        mlp_frozen(),
        ADAMW,
        F.cross_entropy,
        data,
        4,
        precision=precision,
        loss_scale=2.0**16 if precision == "fp16" else None,
    )
    with Trainer(model, ADAMW, F.cross_entropy, microbatches=4, precision=precision) as t:
        assert [t.step(x, y) for x, y in data] == want
        state = t.state_dict()
        t.save(tmp_path)
        held = t.module.get_parameter("0.weight")
        assert held.dtype == reference.DTYPES[precision]
        assert not torch.equal(held.float(), frozen["0.weight"])  # the stage holds it rounded
    for name, value in frozen.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    trained = [n for n, p in mlp().named_parameters() if n not in frozen]
    for name, master in zip(trained, masters):
        assert torch.equal(state[name], master), name
    assert not hasattr(held, "_myelin_exact")  # given back with the model at close
    for again in (precision, "fp32"):  # resumed: the exact value again, not its rounding
        with Trainer(mlp_frozen(), ADAMW, F.cross_entropy, precision=again, resume=tmp_path) as t:
            assert torch.equal(t.state_dict()["0.weight"], frozen["0.weight"]), again


def mlp_frozen():
    model = mlp()
    model[0].weight.requires_grad_(False)
    model[3].bias.requires_grad_(False)
    model[3].bias.data = model[3].bias.data.to(torch.bfloat16).float()
    return model


# -- 17.7: half-precision gradients are summed over microbatches in fp32 ----------------------


def test_half_precision_sums_microbatch_gradients_in_fp32():
    data = batches(2, rows=64)
    losses, _, _ = run(mlp(), data, precision="bf16", microbatches=32)
    want, _, _ = reference.train(mlp(), ADAMW, F.cross_entropy, data, 32, precision="bf16")
    assert losses == want


# -- 17.4: an optimizer factory that groups parameters by name --------------------------------


def no_decay_for_biases_and_norms(params):
    """The nanoGPT / transformers idiom, on the parameters myelin gives (by name)."""
    named = list(params.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and p.dim() >= 2]
    plain = [p for n, p in named if not (n.endswith("weight") and p.dim() >= 2)]
    groups = [{"params": decay, "weight_decay": 0.5}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2)


@pytest.mark.parametrize(
    "kwargs", [{}, {"offload": HOST}, {"precision": "bf16"}], ids=["plain", "offload", "bf16"]
)
def test_an_optimizer_factory_can_group_parameters_by_name(kwargs):
    data = batches(4)
    losses, state, _ = run(mlp(), data, optimizer=no_decay_for_biases_and_norms, **kwargs)
    model = mlp()

    def by_name(masters):  # the same groups, built from the model's own names
        named = [(n, m) for (n, _), m in zip(model.named_parameters(), masters)]
        decay = [m for n, m in named if n.endswith("weight") and m.dim() >= 2]
        plain = [m for n, m in named if not (n.endswith("weight") and m.dim() >= 2)]
        groups = [{"params": decay, "weight_decay": 0.5}, {"params": plain, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2)

    precision = kwargs.get("precision", "fp32")
    want, masters, _ = reference.train(
        model, by_name, F.cross_entropy, data, 4, precision=precision
    )
    assert losses == want
    for (name, _), master in zip(model.named_parameters(), masters):
        assert torch.equal(state[name], master), name


@pytest.mark.parametrize(
    "kwargs", [{}, {"offload": HOST}, {"precision": "bf16"}], ids=["plain", "offload", "bf16"]
)
def test_an_optimizer_over_parameters_it_was_not_given_is_refused(kwargs):
    model = mlp()
    other = mlp()  # e.g. a closure over another copy of the model, or over all stages

    def closure(params):
        return torch.optim.AdamW(other.parameters(), lr=1e-2)

    with pytest.raises(ConfigError, match="not the parameters it was given"):
        Trainer(model, closure, F.cross_entropy, **kwargs)


# -- 17.5: Trainer(max_grad_norm=...) equals clip_grad_norm_ over the whole model ---------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"offload": HOST}, {"offload": STREAM}, {"precision": "bf16"}],
    ids=["device", "host", "stream", "bf16"],
)
def test_max_grad_norm_equals_clip_grad_norm(kwargs):
    data = batches(4)
    losses, state, _ = run(mlp(), data, max_grad_norm=0.05, **kwargs)
    model = mlp()
    precision = kwargs.get("precision", "fp32")
    want, masters, _ = reference.train(
        model, ADAMW, F.cross_entropy, data, 4, precision=precision, max_grad_norm=0.05
    )
    unclipped, _, _ = reference.train(mlp(), ADAMW, F.cross_entropy, data, 4, precision=precision)
    assert want != unclipped  # the norm is small enough to clip
    assert losses == want
    for (name, _), master in zip(model.named_parameters(), masters):
        assert torch.equal(state[name], master), name


def test_max_grad_norm_is_checked():
    with pytest.raises(ConfigError, match="max_grad_norm=0"):
        Trainer(mlp(), ADAMW, F.cross_entropy, max_grad_norm=0)


# -- 17.6: resuming with an LR scheduler gives the same next losses ---------------------------


def warmup_cosine(optimizer):
    def factor(step):
        return (step + 1) / 3 if step < 3 else 0.5 * (1 + math.cos(math.pi * min(1, step / 8)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def steps(trainer, data):
    """Train on `data`, stepping the trainer's LR scheduler after each step as fit does."""
    losses = []
    for x, y in data:
        losses.append(trainer.step(x, y))
        trainer.lr_scheduler.step()
    return losses


@pytest.mark.parametrize("offload", [None, HOST], ids=["device", "host"])
def test_resume_with_an_lr_scheduler_continues_the_same_losses(tmp_path, offload):
    data = batches(8)
    kw = dict(microbatches=4, lr_schedule=warmup_cosine, offload=offload)
    with Trainer(mlp(), ADAMW, F.cross_entropy, **kw) as t:
        whole = steps(t, data)
    want, _, _ = reference.train(mlp(), ADAMW, F.cross_entropy, data, 4, scheduler=warmup_cosine)
    assert whole == want
    with Trainer(mlp(), ADAMW, F.cross_entropy, **kw) as t:
        first = steps(t, data[:4])
        t.save(tmp_path)
    with Trainer(mlp(), ADAMW, F.cross_entropy, resume=tmp_path, **kw) as t:
        assert t.lr_scheduler.last_epoch == 4
        assert t.optimizer.param_groups[0]["lr"] == t.lr_scheduler.get_last_lr()[0]
        rest = steps(t, data[4:])
    assert first + rest == whole


def test_a_scheduler_built_after_resuming_continues_from_the_checkpoint(tmp_path):
    """The scheduler built on the resumed trainer (trainer.set_lr_schedule, as fit builds
    its lr_schedule) keeps the checkpoint's learning rate, not its own first one."""
    data = batches(6)
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4) as t:
        t.set_lr_schedule(warmup_cosine)
        whole = steps(t, data)
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4) as t:
        t.set_lr_schedule(warmup_cosine)
        steps(t, data[:3])
        t.save(tmp_path)
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4, resume=tmp_path) as t:
        t.set_lr_schedule(warmup_cosine)
        assert steps(t, data[3:]) == whole[3:]


def test_a_scheduler_built_after_steps_past_the_resume_does_not_rewind_to_it(tmp_path):
    """The checkpoint's scheduler state goes to a scheduler built before the next step only:
    rebuilt after steps past it (fit(lr_schedule=f) on a trainer that already trained), the
    schedule starts afresh, as on a trainer never resumed, not back at the checkpoint."""
    data = batches(6)
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4, lr_schedule=warmup_cosine) as t:
        steps(t, data[:2])
        t.save(tmp_path)
    runs = []
    for resume in (tmp_path, None):
        with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4, lr_schedule=warmup_cosine,
                     resume=resume) as t:  # fmt: skip
            steps(t, data[2:5])
            t.set_lr_schedule(warmup_cosine)
            runs.append(t.lr_scheduler.last_epoch)
    assert runs == [0, 0]


def test_a_checkpoints_scheduler_into_another_class_is_refused_naming_both(tmp_path):
    """A LambdaLR's state loaded into a StepLR mixed the two (base_lrs, last_epoch...);
    the optimizer's class was checked, the scheduler's was not."""
    data = batches(3)
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4, lr_schedule=warmup_cosine) as t:
        steps(t, data)
        t.save(tmp_path)

    def step_lr(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    for how in ("built", "later"):
        kw = {"lr_schedule": step_lr} if how == "built" else {}
        with pytest.raises(myelin.CheckpointError, match=r"LambdaLR, this run's a .*StepLR"):
            with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4, resume=tmp_path,
                         **kw) as t:  # fmt: skip
                t.set_lr_schedule(step_lr)
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4, resume=tmp_path,
                 lr_schedule=warmup_cosine) as t:  # fmt: skip
        assert t.lr_scheduler.last_epoch == 3  # the same class resumes


# -- 17.9: a DataLoader's short last batch -----------------------------------------------------


def loader(n, batch_size=8, **kw):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (n,), generator=g)), batch_size, **kw)


def test_fit_and_evaluate_take_a_short_last_batch():
    data = loader(22)  # batches of 8, 8 and 6 rows: 6 splits into 2, 2, 1, 1
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4) as t:
        history = t.fit(data, epochs=2, log_every=1, progress=False)
        val = t.evaluate(data)
        state = t.state_dict()
    model = mlp()
    want, _, _ = reference.train(model, ADAMW, F.cross_entropy, list(data) * 2, 4)
    assert [h["loss"] for h in history] == want
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name
    with torch.no_grad():  # the mean over every row, as a batch of 22 would give
        rows = [(F.cross_entropy(model(x), y, reduction="sum"), len(y)) for x, y in data]
        per_batch = [float(s) / n for s, n in rows]
    assert val == pytest.approx(sum(per_batch) / len(per_batch), rel=1e-6)


def test_a_last_batch_smaller_than_the_microbatches_is_refused_before_training():
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4) as t:
        with pytest.raises(ConfigError, match="3 rows.*microbatches=4.*drop_last=True"):
            t.fit(loader(19), progress=False)  # 8, 8, 3
        assert t.steps_done == 0
        t.fit(loader(19, drop_last=True), progress=False)
        assert t.steps_done == 2


def test_fit_callbacks_hear_of_every_step():
    """A per-step scheduler steps in on_step_end, whatever log_every is."""
    data = loader(64)

    class EachStep(myelin.Callback):
        def __init__(self, scheduler):
            self.scheduler, self.seen = scheduler, []

        def on_step_end(self, trainer, step, loss):
            self.scheduler.step()
            self.seen.append((step, loss))

    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=4) as t:
        each = EachStep(warmup_cosine(t.optimizer))
        history = t.fit(data, log_every=4, progress=False, callbacks=[each])
    want, _, _ = reference.train(
        mlp(), ADAMW, F.cross_entropy, list(data), 4, scheduler=warmup_cosine
    )
    assert [s for s, _ in each.seen] == list(range(1, 9))
    assert [loss for _, loss in each.seen] == want
    assert [h["step"] for h in history] == [4, 8]


# -- 17.2 (one process): myelin's dropout does not draw from the user's generator ----------------


def test_dropout_of_a_model_run_whole_equals_it_run_as_its_layers():
    """A one-stage model with pipeline_layers() runs its own forward, but its layers draw
    from the streams a split run gives them: the same masks as partition=[all layers], and
    so as any split of it (it drew from one stream of its own)."""
    from myelin.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16, dropout=0.3)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 32, (8, 17), generator=g) for _ in range(3)]
    runs = []
    for partition in (None, [cfg.n_layer + 2]):
        torch.manual_seed(0)
        with Trainer(GPT(cfg), ADAMW, lm_loss, microbatches=2, partition=partition) as t:
            runs.append([t.step(x[:, :-1], x[:, 1:]) for x in data])
    assert runs[0] == runs[1]


def test_training_leaves_the_users_random_generator_alone():
    """Each layer draws from a stream of its own, so every rank's global generator (and a
    DataLoader shuffling with it) advances only by the script's own draws."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with Trainer(copy.deepcopy(model), ADAMW, F.cross_entropy, microbatches=4) as t:
        for x, y in batches(2):
            t.step(x, y)
        assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_batchnorm_stays_fp32_under_half_precision(precision):
    """A running mean in half precision stops moving once momentum x (x - mean) falls under
    its rounding (bf16 stalled at 0.84 on its way to 0.95 here); BatchNorm stays fp32, as
    under autocast, and its statistics follow fp32's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=0.01), nn.Linear(4, 2))
    with torch.no_grad():  # the batch norm sees inputs of mean 1 in every feature
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)
    sgd = functools.partial(torch.optim.SGD, lr=0.0)
    t = myelin.Trainer(model, sgd, F.cross_entropy, microbatches=1, precision=precision)
    try:
        x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
        for _ in range(300):
            t.step(x, y)
        bn = t.module[1] if isinstance(t.module, nn.Sequential) else None
        state = t.state_dict()
        mean = state["1.running_mean"]
        assert mean.dtype == torch.float32
        want = 1 - 0.99**300  # the fp32 running mean of a constant 1 after 300 updates
        assert torch.allclose(mean, torch.full((4,), want), atol=1e-3), (mean, want)
        if bn is not None:
            assert bn.weight.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    finally:
        t.close()


def test_a_float64_model_is_said_to_train_in_the_precision_given(caplog):
    model = nn.Sequential(nn.Linear(4, 2)).double()
    with caplog.at_level("WARNING", logger="myelin.stage_setup"):
        t = myelin.Trainer(model, functools.partial(torch.optim.SGD, lr=0.1), F.mse_loss)
    try:
        assert "float64 parameters train as torch.float32" in caplog.text
        assert all(p.dtype == torch.float32 for p in t.module.parameters())
    finally:
        t.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_batchnorm_keeps_its_exact_fp32_values_under_half_precision(precision):
    """Not a round trip through half precision: a loaded model's statistics stay as saved."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].running_mean.fill_(0.123456789)
        model[1].weight.fill_(1.001)
    want = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("1.")}
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    t = myelin.Trainer(model, sgd, F.mse_loss, precision=precision)
    try:
        state = t.state_dict()
        for k, v in want.items():
            assert torch.equal(state[k], v), k
    finally:
        t.close()


# -- a last layer's own return value reaches loss_fn ------------------------------------------


class _Returns(nn.Module):
    """mlp() whose last layer returns its logits wrapped as `kind` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body, self.kind = mlp(), kind

    def forward(self, x):
        logits = self.body(x)
        if self.kind == "tuple":
            return (logits,)
        if self.kind == "dict":
            return {"logits": logits, "aux": logits.detach().sum()}
        return [logits, logits.detach()]


def _unwrap(out, y):
    logits = out["logits"] if isinstance(out, dict) else out[0]
    assert logits.dtype == torch.float32  # the loss is computed in full precision
    return F.cross_entropy(logits, y)


@pytest.mark.parametrize("kind", ["tuple", "dict", "list"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loss_fn_gets_the_last_layers_own_return_value(kind, precision):
    """A last layer returning (logits,), a dict or a list: loss_fn gets that value as in
    one process (a 1-tuple was unwrapped, so out[0] was the first row; a dict refused)."""
    torch.manual_seed(0)
    model = _Returns(kind)
    data = batches(3)
    with Trainer(copy.deepcopy(model), ADAMW, _unwrap, microbatches=4, precision=precision) as t:
        losses = [t.step(x, y) for x, y in data]
        evals = [t.eval_step(x, y) for x, y in data]
    if precision == "fp32":
        want, _, _ = reference.train(model, ADAMW, _unwrap, data, 4)
        assert losses == want
    assert all(math.isfinite(v) for v in losses + evals)


def test_a_sequential_whose_last_layer_returns_a_tuple_gives_loss_fn_that_tuple():
    torch.manual_seed(0)
    model = nn.Sequential(*mlp(), _Wrap())
    data = batches(2)
    with Trainer(copy.deepcopy(model), ADAMW, _unwrap, microbatches=4) as t:
        losses = [t.step(x, y) for x, y in data]
    want, _, _ = reference.train(model, ADAMW, _unwrap, data, 4)
    assert losses == want


class _Wrap(nn.Module):
    def forward(self, x):
        return (x,)


# -- targets flattened over tokens; a DataLoader's collated tuple -----------------------------


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (n, 5), generator=g), torch.randint(0, 10, (n * 5,), generator=g)


def _token_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10), nn.Flatten(0, 1))


def test_targets_flattened_over_tokens_pair_with_their_rows_in_a_short_batch():
    """Inputs (N, T), targets (N*T,), N=7 over 4 microbatches: targets are cut at the inputs'
    boundaries (each cut alone, 2,2,2,1 rows against 9,9,9,8 tokens, failed in the loss)
    and each microbatch counts by its tokens, so the step equals one process."""
    x, y = _tokens(7)
    model = _token_model()
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with Trainer(copy.deepcopy(model), sgd, F.cross_entropy, microbatches=4) as t:
        got = t.step(x, y)
        after = t.state_dict()
    plain = sgd(model.parameters())
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    plain.step()
    assert got == pytest.approx(loss.item(), rel=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(after[name], value, rtol=1e-6, atol=1e-7)


def test_targets_of_another_row_count_in_a_short_batch_are_refused_naming_both():
    x, _ = _tokens(7)
    with Trainer(_token_model(), ADAMW, F.cross_entropy, microbatches=4) as t:
        with pytest.raises(ConfigError, match="targets have 12 rows and inputs 7"):
            t.step(x, torch.zeros(12, dtype=torch.long))


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 3)

    def forward(self, x, mask):
        return self.l(x * mask)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_a_loaders_collated_tuple_of_inputs_is_a_tuple_not_microbatches(microbatches):
    """A dataset of ((x, mask), y): default_collate makes the inner tuple a list, which was
    read as per-microbatch entries (a missing argument, or a count mismatch)."""
    g = torch.Generator().manual_seed(0)
    ds = [((torch.randn(6, generator=g), torch.ones(6)), i % 3) for i in range(8)]
    (inputs, y) = next(iter(DataLoader(ds, batch_size=8)))
    assert isinstance(inputs, list)
    torch.manual_seed(0)
    model = _Masked()
    with Trainer(copy.deepcopy(model), ADAMW, F.cross_entropy, microbatches=microbatches) as t:
        got = t.eval_step(inputs, y)
        rows = t.fit(DataLoader(ds, batch_size=8), steps=1, progress=False)
    want = F.cross_entropy(model(*inputs), y).item()
    assert got == pytest.approx(want, rel=1e-6) and rows[0]["loss"] == pytest.approx(want, rel=1e-6)


Weighted = collections.namedtuple("Weighted", "label weight")


def _weighted_ce(out, target):
    label = target["label"] if isinstance(target, dict) else target.label
    weight = target["weight"] if isinstance(target, dict) else target.weight
    return (F.cross_entropy(out, label, reduction="none") * weight).mean()


@pytest.mark.parametrize("kind", ["namedtuple", "dict"])
@pytest.mark.parametrize("rows", [16, 14], ids=["even", "short"])
def test_targets_as_a_namedtuple_or_dict_reach_loss_fn_as_they_were_given(kind, rows):
    """Each microbatch's targets keep their type (a namedtuple became a plain tuple, a dict
    was refused), and training equals torch's on the whole batch."""
    data = batches(3, rows=rows)
    g = torch.Generator().manual_seed(3)
    weights = [torch.rand(rows, generator=g) for _ in data]

    def target(y, w):
        return Weighted(y, w) if kind == "namedtuple" else {"label": y, "weight": w}

    ref = mlp()
    opt = ADAMW(ref.parameters())
    want = []
    for (x, y), w in zip(data, weights, strict=True):
        opt.zero_grad()
        loss = _weighted_ce(ref(x), target(y, w))
        loss.backward()
        opt.step()
        want.append(loss.item())
    seen = []

    def loss_fn(out, t):
        seen.append(type(t))
        return _weighted_ce(out, t)

    with Trainer(mlp(), ADAMW, loss_fn, microbatches=4) as t:
        got = [t.step(x, target(y, w)) for (x, y), w in zip(data, weights, strict=True)]
        trained = t.state_dict()
    assert set(seen) == {Weighted if kind == "namedtuple" else dict}
    assert got == pytest.approx(want, rel=1e-5)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6)


def test_inputs_as_a_dict_are_refused_saying_to_pass_a_tuple():
    with Trainer(mlp(), ADAMW, F.cross_entropy, microbatches=2) as t:
        x, y = batches(1)[0]
        with pytest.raises(ConfigError, match="inputs is a dict; pass a tensor or a tuple"):
            t.step({"x": x}, y)


SGD = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("offload", [None, HOST], ids=["device", "host"])
def test_a_parameter_edited_in_place_between_steps_reaches_its_master(precision, offload):
    """Zeroing the head under no_grad, as in fp32: state_dict() holds the zeros, and the
    next step starts from them (the masters had kept the old weights, which the next
    update copied back). Equal to a trainer built from the edited model."""
    data = batches(2)
    model = mlp()
    with Trainer(model, SGD, F.cross_entropy, microbatches=2, precision=precision,
                 offload=offload) as t:  # fmt: skip
        t.step(*data[0])
        with torch.no_grad():
            t.module[5].weight.zero_()
        edited = t.state_dict()
        t.step(*data[1])
        after = t.state_dict()
    assert torch.equal(edited["5.weight"], torch.zeros_like(edited["5.weight"]))
    fresh = mlp()
    fresh.load_state_dict(edited)
    with Trainer(fresh, SGD, F.cross_entropy, microbatches=2, precision=precision,
                 offload=offload) as t:  # fmt: skip
        t.step(*data[1])
        want = t.state_dict()
    for k, v in want.items():
        assert torch.equal(after[k], v), k


def test_a_parameter_unfrozen_after_the_trainer_was_built_is_refused_naming_it():
    """The optimizer was built over the parameters that trained then: an unfrozen one
    would never change (it stayed at its value, silently). Frozen later is fine."""
    model = mlp()
    model[0].weight.requires_grad_(False)
    with Trainer(model, SGD, F.cross_entropy, microbatches=2) as t:
        x, y = batches(1)[0]
        t.step(x, y)
        model[5].bias.requires_grad_(False)  # frozen later: skipped, as torch's SGD skips it
        t.step(x, y)
        model[0].weight.requires_grad_(True)
        before = t.state_dict()
        with pytest.raises(ConfigError, match=r"frozen when the Trainer was built .*0\.weight"):
            t.step(x, y)
        model[0].weight.requires_grad_(False)  # the step was forgotten: the trainer goes on
        t.step(x, y)
        assert torch.equal(t.state_dict()["0.weight"], before["0.weight"])
