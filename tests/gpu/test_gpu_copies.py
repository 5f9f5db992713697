"""Every asynchronous copy is waited for before its data is read or its memory reused.

Each test poisons what a copy is about to overwrite (or what would take the place of the
memory it reads), holds the copy stream back with `torch.cuda._sleep`, and checks that
training is still bit-identical to the same run unpoisoned. A companion test breaks the
waits myelin relies on (record_stream, Stream.wait_event, Event.synchronize/query) and
checks that the same poison then shows: otherwise the first test could not catch the bug
it is for.

The copies, in myelin/offload/pages.py (run by activations.py), optimizer.py and streaming.py:
- page-out: a saved activation's storage, device -> pinned pool, on the copier's side
  stream, layer by layer as the forward goes; the device storage is freed as the forward
  moves on, so only `record_stream` keeps the caching allocator from handing it to the
  next kernel before the copy read it;
- fetch: the page back, pinned pool -> a new device buffer, on the same side stream, a
  layer ahead of backward; backward must wait for the copy's event before reading it;
- "stream" optimizer: masters and state, pool -> device, per bucket on the updater's side
  stream; the update must wait for them;
- "host" optimizer: gradients device -> pinned pool (the CPU update must wait), then the
  updated weights pool -> device (the next forward must wait).

The sends between stages are poisoned the same way in test_gpu_pipeline.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import myelin
import myelin.offload.pages as pages_mod
import myelin.offload.streaming as streaming_mod
from myelin.offload.activations import ActivationStore
from myelin.offload.optimizer import Updater
from myelin.offload.pages import Copier
from tests.gpu._gpu import DELAY_CYCLES, delay, train

pytestmark = pytest.mark.gpu

# 16 KiB keeps the saved token ids and targets (2 KiB a microbatch) on the device: the
# checks below poison pages, and poisoned indices would stop the GPU at a device-side
# assert (a sticky error that breaks every later test in the process) rather than show.
ACT = myelin.OffloadConfig(activations=True, min_bytes="16KiB")
STREAM = myelin.OffloadConfig(optimizer="stream", bucket_bytes="64KiB")
HOST = myelin.OffloadConfig(optimizer="host", bucket_bytes="64KiB")
# GPipe: microbatches wait in the pipeline, all their pages leave; message-driven on one
# stage: each backward follows its forward, pages leave and come back layer by layer.
SCHEDULES = pytest.mark.parametrize("schedule", ["gpipe", "message-driven"])


def _poison(t: torch.Tensor) -> None:
    """0xFF in every byte: NaN in fp32, bf16 and fp16."""
    t.view(torch.uint8).fill_(0xFF)


def _break_waits(monkeypatch, *, record_stream=False, events=False) -> None:
    """What a broken implementation would do: not protect memory, not wait."""
    if record_stream:
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    if events:
        monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, event: None)
        monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: None)
        monkeypatch.setattr(torch.cuda.Event, "query", lambda self: True)


# -- activations: page-out ---------------------------------------------------------------------


def _poison_page_outs(monkeypatch) -> None:
    """Hold the store's side stream back before every page-out copy, and after each
    forward fill fresh allocations of the pages' sizes with NaN on the compute stream: were
    a paged storage's memory handed out again before its copy read it, the page would
    hold NaN."""
    copy_out, saving = Copier.copy_out, ActivationStore.saving

    def slow_copy_out(self, page, pool):
        delay(self._stream, DELAY_CYCLES // 5)  # per page: the side stream's backlog adds up
        return copy_out(self, page, pool)

    @contextlib.contextmanager
    def saving_then_flood(self, mb, keep=(), backward_next=False):
        with saving(self, mb, keep, backward_next):
            yield
        for page in self._mbs[mb].pages:
            for _ in range(2):
                _poison(torch.empty(page.nbytes, dtype=torch.uint8, device=self.device))

    monkeypatch.setattr(Copier, "copy_out", slow_copy_out)
    monkeypatch.setattr(ActivationStore, "saving", saving_then_flood)


@SCHEDULES
def test_page_out_keeps_the_device_storage_until_its_copy_read_it(
    deterministic, fresh_device, monkeypatch, schedule
):
    clean = train(offload=ACT, schedule=schedule)
    assert clean.stats["activations_offloaded_total_bytes"] > 0
    _poison_page_outs(monkeypatch)
    poisoned = train(offload=ACT, schedule=schedule)
    assert poisoned.same_as(clean), (poisoned.losses, clean.losses)


@SCHEDULES
def test_page_out_poison_catches_memory_reused_before_its_copy(
    deterministic, fresh_device, monkeypatch, schedule
):
    clean = train(offload=ACT, schedule=schedule)
    _poison_page_outs(monkeypatch)
    _break_waits(monkeypatch, record_stream=True)
    broken = train(offload=ACT, schedule=schedule)
    assert not broken.same_as(clean), (
        "without record_stream the poisoned page-outs still trained identically: the test "
        "above cannot catch the bug it is for"
    )


# -- activations: fetch --------------------------------------------------------------------------


class _TorchWithPoisonedBuffers:
    """Stands in for `torch` inside myelin/offload/pages.py: every non-empty uint8
    device buffer it makes (the buffers pages are fetched into) starts as NaN, filled on
    the stream current at that moment (the side stream, ahead of the copy)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        if t.is_cuda and t.dtype == torch.uint8 and t.numel():
            _poison(t)
        return t


def _poison_fetches(monkeypatch) -> None:
    copy_in = Copier.copy_in

    def slow_copy_in(self, page):
        delay(self._stream, DELAY_CYCLES // 5)  # per page, as backward reaches each layer
        return copy_in(self, page)

    monkeypatch.setattr(Copier, "copy_in", slow_copy_in)
    monkeypatch.setattr(pages_mod, "torch", _TorchWithPoisonedBuffers())


@SCHEDULES
def test_backward_reads_a_page_only_after_it_came_back(
    deterministic, fresh_device, monkeypatch, schedule
):
    clean = train(offload=ACT, schedule=schedule)
    _poison_fetches(monkeypatch)
    poisoned = train(offload=ACT, schedule=schedule)
    assert poisoned.same_as(clean), (poisoned.losses, clean.losses)


@SCHEDULES
def test_fetch_poison_catches_backward_that_does_not_wait(
    deterministic, fresh_device, monkeypatch, schedule
):
    clean = train(offload=ACT, schedule=schedule)
    _poison_fetches(monkeypatch)
    _break_waits(monkeypatch, events=True)
    broken = train(offload=ACT, schedule=schedule)
    assert not broken.same_as(clean), (
        "backward that does not wait for its pages still trained identically: the test "
        "above cannot catch the bug it is for"
    )


# -- the "stream" optimizer ---------------------------------------------------------------------


def _poison_stage_in(monkeypatch) -> None:
    """The state and masters staged in for a bucket's update start as NaN on the device,
    behind a held-back side stream; the copy from the pool lands after that."""

    def slow_poisoned_to_device(t, device):  # what streaming._to_device does, poisoned first
        torch.cuda._sleep(DELAY_CYCLES // 5)  # on the current stream: the updater's side stream
        out = torch.empty_like(t, device=device)
        _poison(out)
        out.copy_(t, non_blocking=True)
        return out

    monkeypatch.setattr(streaming_mod, "_to_device", slow_poisoned_to_device)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stream_optimizer_updates_only_what_has_arrived(
    deterministic, fresh_device, monkeypatch, precision
):
    clean = train(offload=STREAM, precision=precision)
    _poison_stage_in(monkeypatch)
    poisoned = train(offload=STREAM, precision=precision)
    assert poisoned.same_as(clean), (poisoned.losses, clean.losses)


def test_stream_poison_catches_an_update_that_does_not_wait(
    deterministic, fresh_device, monkeypatch
):
    clean = train(offload=STREAM)
    _poison_stage_in(monkeypatch)
    _break_waits(monkeypatch, events=True)
    broken = train(offload=STREAM)
    assert not broken.same_as(clean)


# -- the "host" optimizer -----------------------------------------------------------------------


def _poison_host_update(monkeypatch) -> None:
    """Host gradient buffers hold NaN until each bucket's copy lands (the copy held back);
    the updated weights' copy back to the device is held back too."""
    copy_grads, adopt_state = Updater._copy_grads, Updater._adopt_state

    def poisoned_copy_grads(self, b):
        for i in self._buckets[b]:
            _poison(self._host_grads[i])  # CPU memory, before the copy is queued
        delay(self._stream)
        return copy_grads(self, b)

    def adopt_state_then_wait(self, indices):
        # _host_bucket: CPU update, _adopt_state, then the weights' copies to the device
        adopt_state(self, indices)
        delay(self._stream)

    monkeypatch.setattr(Updater, "_copy_grads", poisoned_copy_grads)
    monkeypatch.setattr(Updater, "_adopt_state", adopt_state_then_wait)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_host_optimizer_waits_for_gradients_and_weights(
    deterministic, fresh_device, monkeypatch, precision
):
    clean = train(offload=HOST, precision=precision)
    _poison_host_update(monkeypatch)
    poisoned = train(offload=HOST, precision=precision)
    assert poisoned.same_as(clean), (poisoned.losses, clean.losses)


def test_host_poison_catches_an_update_that_does_not_wait(deterministic, fresh_device, monkeypatch):
    clean = train(offload=HOST)
    _poison_host_update(monkeypatch)
    _break_waits(monkeypatch, events=True)
    broken = train(offload=HOST)
    assert not broken.same_as(clean)
