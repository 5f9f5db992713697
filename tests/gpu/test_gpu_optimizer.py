"""The optimizer offload modes on a GPU: "stream" equals "host" (and no offload).

"stream" runs torch's own CUDA foreach kernels on each bucket's staged masters and state,
elementwise the same arithmetic as one step over all parameters on the device, so it must
equal no offload bit for bit. "host" runs the same optimizer on the CPU, whose kernels
round differently (FMA contraction, vector widths), so "host" matches "stream" to
HOST_RTOL / HOST_ATOL on the fp32 masters, and the losses to LOSS_RTOL.

In fp32 that holds after three AdamW steps. Under bf16 and fp16 it holds after the first
step only: from then on a weight one rounding step apart changes the next gradients at
half precision, and AdamW turns a gradient that is only rounding noise (the attention's
key bias, whose gradient is zero in exact arithmetic) into a full step of lr with a sign
of its own: an H200 run saw masters 1.2e-3 apart after three steps at lr 1e-3. So the
three-step runs compare losses, and the masters are compared after step 1.
"""

from __future__ import annotations

import pytest
import torch

import myelin
from tests.gpu._gpu import train

pytestmark = pytest.mark.gpu

HOST_RTOL, HOST_ATOL = 1e-5, 1e-6
HALF_RTOL = {"fp32": HOST_RTOL, "bf16": 2.0**-7, "fp16": 2.0**-10}  # or one rounding step apart
LOSS_RTOL = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 1e-3}


MODES = ("stream", "host")


def _offload(mode):
    return myelin.OffloadConfig(optimizer=mode, bucket_bytes="64KiB")  # several buckets


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_stream_mode_equals_no_offload_and_host_mode(deterministic, fresh_device, precision):
    device = train(precision=precision)
    stream = train(precision=precision, offload=_offload("stream"))
    host = train(precision=precision, offload=_offload("host"))
    assert stream.stats["optimizer_mode"] == "stream" and host.stats["optimizer_mode"] == "host"
    assert stream.stats["optimizer_host_bytes"] > 0 and host.stats["optimizer_host_bytes"] > 0
    assert stream.same_as(device), (stream.losses, device.losses)

    for a, b in zip(host.losses, stream.losses, strict=True):
        assert abs(a - b) <= LOSS_RTOL[precision] * abs(b), (host.losses, stream.losses)
    if precision != "fp32":  # the same gradients, one step: only the optimizer's rounding
        stream, host = (train(steps=1, precision=precision, offload=_offload(m)) for m in MODES)
    for a, b in zip(host.masters, stream.masters, strict=True):
        torch.testing.assert_close(a, b, rtol=HOST_RTOL, atol=HOST_ATOL)
    for a, b in zip(host.params, stream.params, strict=True):  # at most a rounding step apart
        torch.testing.assert_close(a.float(), b.float(), rtol=HALF_RTOL[precision], atol=HOST_ATOL)


def test_optimizer_true_picks_stream_on_a_gpu(fresh_device):
    run = train(steps=1, offload=myelin.OffloadConfig(optimizer=True))
    assert run.stats["optimizer_mode"] == "stream"
    assert run.stats["device_peak_measured_by"] == "torch.cuda"
