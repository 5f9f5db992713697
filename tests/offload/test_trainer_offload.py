"""Offload through the Trainer: same results, less device memory, clear errors.

The multi-process cases (2 and 4 stages, data parallel, tied weights) are in
tests/runtime/test_pipeline.py; these run one stage in this process.
"""

from __future__ import annotations

import functools
import gc
import traceback
import weakref

import pytest
import torch

import myelin
from myelin.models import GPT, GPTConfig, lm_loss

OFFLOADS = {
    "none": None,
    "act": myelin.OffloadConfig(activations=True, min_bytes=0),
    "opt": myelin.OffloadConfig(optimizer=True, bucket_bytes="16KiB"),
    "stream": myelin.OffloadConfig(optimizer="stream", bucket_bytes="16KiB"),
    "both": myelin.OffloadConfig(activations=True, optimizer=True, min_bytes=0),
}

# Activations dominate: 8 microbatches of 2 x 128 tokens all in flight (GPipe) on a
# 2-layer, 64-wide GPT: about 18 MB of saved activations against 1.9 MB of parameters,
# gradients and AdamW state.
BIG = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, d_model=64)
SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, d_model=32)
# One process, two microbatches, each backward right after its forward: only one
# microbatch is ever in flight, so only paging within it can lower the peak. Deep enough
# that about one layer on the device at a time is a small part: 8 blocks of 8 x 128 tokens.
DEEP = GPTConfig(vocab_size=64, block_size=128, n_layer=8, n_head=4, d_model=32)


def train(cfg, steps=3, schedule="gpipe", save=None, load=None, model=None, **kw):
    """Losses, final parameters and memory stats of a one-stage Trainer on fixed batches."""
    torch.manual_seed(0)
    kw.setdefault("microbatches", 8)
    trainer = myelin.Trainer(
        GPT(cfg) if model is None else model(GPT(cfg)),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        lm_loss,
        schedule=schedule,
        **kw,
    )
    with trainer:
        if load is not None:
            trainer.load(load)
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(steps):
            x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size + 1), generator=g)
            if step < trainer.steps_done:
                continue
            losses.append(trainer.step(x[:, :-1], x[:, 1:]))
            if save is not None and trainer.steps_done == save[1]:
                trainer.save(save[0])
        params = [p.detach().clone() for p in trainer.module.parameters()]
        return losses, params, trainer.memory_stats()


@pytest.mark.parametrize(
    "schedule", ["gpipe", pytest.param("message-driven", marks=pytest.mark.slow)]
)
def test_every_offload_trains_bit_identically(schedule):
    base_losses, base_params, _ = train(SMALL, schedule=schedule)
    for name, offload in OFFLOADS.items():
        losses, params, stats = train(SMALL, schedule=schedule, offload=offload)
        assert losses == base_losses, name
        assert all(torch.equal(a, b) for a, b in zip(params, base_params, strict=True)), name
        if name in ("act", "both"):  # message-driven: within each microbatch
            assert stats["activations_offloaded_bytes"] > 0
        if name in ("opt", "stream", "both"):
            assert stats["optimizer_host_bytes"] > 0


def test_over_the_device_limit_only_offload_trains():
    limit = "6MiB"
    with pytest.raises(myelin.DeviceMemoryError) as err:
        train(BIG, steps=1, device_memory_limit=limit)
    text = str(err.value)
    assert "device_memory_limit=6 MiB" in text and "OffloadConfig(activations=True)" in text
    assert "activations" in text and "rank 0 (stage 0)" in text

    both = myelin.OffloadConfig(activations=True, optimizer=True)
    losses, params, stats = train(BIG, steps=2, device_memory_limit=limit, offload=both)
    ref_losses, ref_params, ref_stats = train(BIG, steps=2)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert stats["device_peak_measured_by"] == "accounting"
    assert stats["device_peak_bytes"] <= 6 << 20
    assert 4 * stats["device_peak_bytes"] <= ref_stats["device_peak_bytes"], (stats, ref_stats)


class _FailsOnCall(torch.nn.Module):
    """A GPT whose `fail_on`-th forward runs out of memory halfway, after its first block;
    keeps weak references to every block's output (which the next block saves)."""

    def __init__(self, gpt: GPT, fail_on: int) -> None:
        super().__init__()
        self.gpt, self.fail_on, self.calls, self.outputs = gpt, fail_on, 0, []
        for block in gpt.blocks:
            block.register_forward_hook(lambda m, i, out: self.outputs.append(weakref.ref(out)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            self.gpt.blocks[0](self.gpt.embed(idx))
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return self.gpt(idx)


@pytest.mark.parametrize("offload", ["none", "act", "both"])
def test_a_failed_step_frees_what_its_forward_saved(offload):
    """A step that fails (here out of memory, microbatch 4 of 8 under GPipe) leaves nothing
    of its forwards alive once the error is gone: a user who retries with offload, as the
    error says, gets the whole device back (an H200 run kept 1.1 GiB of a failed step)."""
    wrapped = {}

    def failing(gpt):
        wrapped["model"] = _FailsOnCall(gpt, fail_on=4)
        return wrapped["model"]

    with pytest.raises(myelin.DeviceMemoryError) as err:
        train(SMALL, steps=1, model=failing, offload=OFFLOADS[offload])
    _clear_tracebacks(err.value)
    del err
    gc.collect()
    outputs = wrapped["model"].outputs
    assert len(outputs) == 3 * SMALL.n_layer + 1, len(outputs)  # three whole forwards ran
    alive = [tuple(ref().shape) for ref in outputs if ref() is not None]
    assert not alive, f"{len(alive)} of {len(outputs)} block outputs still alive: {alive}"


def _clear_tracebacks(exc: BaseException | None) -> None:
    """Let go of the frames an error's tracebacks hold (and with them the failed run)."""
    while exc is not None:
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


# How the model is given -> the layers its pages fall in: the blocks (the embedding saves
# nothing worth a page), then the head with the loss after the last block (one module:
# the layers found are its blocks), or the head and the loss apart (a list of layers).
GIVEN = {
    "one-module": (None, DEEP.n_layer + 1),
    "layers": (lambda gpt: torch.nn.Sequential(*gpt.pipeline_layers()), DEEP.n_layer + 2),
}


@pytest.mark.parametrize("given", list(GIVEN))
def test_one_process_pages_layer_by_layer_to_a_quarter_of_the_peak(given):
    """stages=1: backward follows each forward at once. Before, nothing was paged and both
    offloads lowered the peak by 1.2x; paged layer by layer it is 4x lower, same results."""
    model, layers = GIVEN[given]
    run = functools.partial(train, DEEP, steps=2, schedule="message-driven", microbatches=2)
    ref_losses, ref_params, ref = run(model=model)
    both = myelin.OffloadConfig(activations=True, optimizer=True)
    losses, params, stats = run(model=model, offload=both)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert 4 * stats["device_peak_bytes"] <= ref["device_peak_bytes"], (stats, ref)
    assert stats["activation_layers"] == layers
    assert stats["activations_offloaded_bytes"] > 0
    assert stats["activations_fetched_bytes"] == stats["activations_offloaded_bytes"]
    assert stats["activations_stayed_bytes"] > 0  # the last layers: never a round trip
    assert stats["prefetch_misses"] == 0 and stats["prefetch_hits"] > 0
    assert stats["fetch_ahead"] == 1


class _Encoder(torch.nn.Module):
    """The issue's case: a torch `nn.TransformerEncoder` of 4 layers inside one module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 128)
        layer = torch.nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def test_a_torch_encoder_given_as_one_module_pages_by_its_layers():
    """Its layers are found inside it (4 blocks and the head), results do not change, and
    the window sets the peak: one layer ahead by default (no backward waits), none at
    fetch_ahead=0 (every page fetched when asked: a quarter of no offload's peak or less,
    a floor set by the parameters and the step's gradients)."""

    def run(offload):
        torch.manual_seed(0)
        loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
        opt = functools.partial(torch.optim.Adam, lr=1e-3)
        with myelin.Trainer(_Encoder(), opt, loss, microbatches=2, offload=offload) as t:
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(2):
                x = torch.randint(0, 64, (16, 129), generator=g)
                losses.append(t.step(x[:, :-1], x[:, 1:]))
            return losses, [p.detach().clone() for p in t.module.parameters()], t.memory_stats()

    ref_losses, ref_params, ref = run(None)
    peaks = {}
    for ahead in (1, 0):
        both = myelin.OffloadConfig(activations=True, optimizer=True, fetch_ahead=ahead)
        losses, params, stats = run(both)
        assert losses == ref_losses, ahead
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)), ahead
        assert stats["activation_layers"] == 5
        assert stats["activations_fetched_bytes"] == stats["activations_offloaded_bytes"] > 0
        peaks[ahead] = stats["device_peak_bytes"]
        misses = stats["prefetch_misses"]
        assert misses == 0 if ahead else misses > 0, (ahead, stats)
    assert 4 * peaks[0] <= ref["device_peak_bytes"], (peaks, ref)
    assert peaks[0] < peaks[1] < ref["device_peak_bytes"] / 2, (peaks, ref)


def test_backward_waiting_for_pages_is_recorded_as_offload_wait():
    """fetch_ahead=0 brings nothing back ahead of backward: every page is a miss, and each
    wait is an offload_wait record inside the backward that waited."""
    off = myelin.OffloadConfig(activations=True, fetch_ahead=0)
    torch.manual_seed(0)
    with myelin.Trainer(GPT(DEEP), torch.optim.AdamW, lm_loss, microbatches=2, offload=off) as t:
        t.timeline.enabled = True
        x = torch.randint(0, DEEP.vocab_size, (16, DEEP.block_size + 1))
        t.step(x[:, :-1], x[:, 1:])
        spans, stats = t.timeline.spans, t.memory_stats()
    waits = [s for s in spans if s.kind == "offload" and s.cause == "offload_wait"]
    backwards = [s for s in spans if s.kind == "backward"]
    assert stats["prefetch_hits"] == 0 and stats["prefetch_misses"] > 0
    assert len(waits) == stats["prefetch_misses"]
    assert stats["offload_wait_seconds"] == pytest.approx(sum(w.end - w.start for w in waits))
    assert all(any(b.start <= w.start <= w.end <= b.end for b in backwards) for w in waits)


def test_memory_stats_report_what_moved():
    both = myelin.OffloadConfig(activations=True, optimizer=True)
    _, _, stats = train(BIG, offload=both)
    for key in (
        "device_peak_bytes",
        "host_pool_peak_bytes",
        "activations_offloaded_bytes",
        "optimizer_host_bytes",
        "prefetch_hits",
        "prefetch_misses",
        "offload_wait_seconds",
    ):
        assert key in stats, key
    params = sum(p.numel() for p in GPT(BIG).parameters())
    # exp_avg and exp_avg_sq (on a CPU in fp32 the masters and grads are the parameters')
    assert stats["optimizer_host_bytes"] == 8 * params
    assert stats["activations_offloaded_bytes"] > stats["device_peak_bytes"]
    assert stats["host_pool_peak_bytes"] >= stats["optimizer_host_bytes"]
    assert stats["prefetch_hits"] > stats["prefetch_misses"] > 0  # the first backward waits
    assert stats["host_pool_in_use_bytes"] == stats["optimizer_host_bytes"]  # pages all freed


def test_the_pool_stops_growing_after_the_first_step():
    both = myelin.OffloadConfig(activations=True, optimizer=True, min_bytes=0)
    torch.manual_seed(0)
    with myelin.Trainer(
        GPT(SMALL),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        lm_loss,
        microbatches=4,
        schedule="gpipe",
        offload=both,
    ) as trainer:
        x = torch.randint(0, 64, (8, 33))
        trainer.step(x[:, :-1], x[:, 1:])
        after_first = (trainer.pool.grows, trainer.pool.capacity_bytes)
        for _ in range(4):
            trainer.step(x[:, :-1], x[:, 1:])
        assert (trainer.pool.grows, trainer.pool.capacity_bytes) == after_first


@pytest.mark.parametrize("schedule", ["gpipe", "message-driven"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_is_unchanged_by_offload(precision, schedule):
    base_losses, base_params, _ = train(SMALL, precision=precision, schedule=schedule)
    assert base_params[0].dtype == myelin.precision.DTYPES[precision]
    for name in ("act", "opt", "stream", "both"):
        run = functools.partial(train, SMALL, precision=precision, schedule=schedule)
        losses, params, stats = run(offload=OFFLOADS[name])
        assert losses == base_losses, name
        assert (stats["activations_offloaded_bytes"] > 0) == (name in ("act", "both")), name
        assert all(torch.equal(a, b) for a, b in zip(params, base_params, strict=True)), name
        assert stats["precision"] == precision


def test_half_precision_tracks_fp32():
    """bf16 rounds activations and weights to 8 bits of mantissa; fp32 master weights keep
    the updates, so the losses stay within a few hundredths of fp32's."""
    fp32, _, _ = train(SMALL, steps=6)
    for precision in ("bf16", "fp16"):
        half, _, stats = train(SMALL, steps=6, precision=precision)
        assert max(abs(a - b) for a, b in zip(half, fp32, strict=True)) < 0.03, precision
    assert stats["loss_scale"] == 2.0**16 and stats["skipped_steps"] == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_resumes_offloaded_training_exactly(tmp_path, precision):
    both = myelin.OffloadConfig(activations=True, optimizer=True, min_bytes=0)
    whole, _, _ = train(SMALL, steps=5, offload=both, precision=precision)
    first, _, _ = train(SMALL, steps=2, offload=both, precision=precision, save=(tmp_path, 2))
    rest, _, _ = train(SMALL, steps=5, offload=both, precision=precision, load=tmp_path)
    assert first + rest == whole
    shard = torch.load(tmp_path / "step-00000002" / "rank0.pt", weights_only=True)
    state = shard["optimizer"]["params"][0]["state"]["exp_avg"]  # by layer (reshard.py)
    assert state.untyped_storage().nbytes() == state.numel() * 4  # a copy, not a pool slab
    # the weights saved are the fp32 masters, also under bf16
    assert {v.dtype for v in shard["model"].values()} == {torch.float32}


def test_a_full_host_pool_names_its_limit():
    small = myelin.OffloadConfig(activations=True, host_memory_limit="1MiB", slab_bytes="1MiB")
    with pytest.raises(myelin.HostMemoryError, match="host_memory_limit"):
        train(BIG, offload=small)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"offload": {"activations": True}}, "offload="),
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"device_memory_limit": "lots"}, "device_memory_limit"),
        ({"device_memory_limit": -1}, "device_memory_limit"),
        ({"offload": myelin.OffloadConfig(optimizer="stream"), "precision": "half"}, "precision"),
    ],
)
def test_bad_memory_settings_are_named(kwargs, text):
    with pytest.raises(myelin.ConfigError, match=text.replace("(", r"\(")):
        myelin.Trainer(GPT(SMALL), torch.optim.AdamW, lm_loss, **kwargs)


@pytest.mark.parametrize("optimizer", [False, True])
def test_half_precision_masters_start_from_the_fp32_weights(optimizer):
    torch.manual_seed(0)
    model = GPT(SMALL)
    weights = [p.detach().clone() for p in model.parameters()]
    offload = myelin.OffloadConfig(optimizer=optimizer)
    with myelin.Trainer(model, torch.optim.AdamW, lm_loss, precision="bf16", offload=offload) as t:
        assert t.module.get_parameter("embed.wte.weight").dtype == torch.bfloat16
        assert all(torch.equal(m, w) for m, w in zip(t.updater.masters, weights, strict=True))


def test_the_host_pool_stops_growing_after_the_first_step():
    """AdamW makes its state during step 1's update; the pool keeps that lasting state apart
    from the activation pages freed meanwhile, so step 2's pages reuse step 1's slabs (the
    GPU suite's check, reproduced on a CPU with slabs smaller than the state)."""
    offload = myelin.OffloadConfig(activations=True, optimizer=True, min_bytes=0, slab_bytes="1MiB")
    torch.manual_seed(0)
    trainer = myelin.Trainer(
        GPT(BIG),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        lm_loss,
        schedule="gpipe",
        microbatches=8,
        offload=offload,
    )
    g = torch.Generator().manual_seed(1)
    grows = []
    with trainer:
        for _ in range(4):
            x = torch.randint(0, BIG.vocab_size, (16, BIG.block_size + 1), generator=g)
            trainer.step(x[:, :-1], x[:, 1:])
            grows.append(trainer.pool.grows)
    assert grows[1:] == grows[:1] * 3, f"slabs after each step: {grows}"
