"""Received tensors are 64-byte aligned, wherever their frame landed (issue 17.8): CPU
kernels take other paths (and round differently) on unaligned inputs, so an unaligned
inline frame made results differ from run to run."""

from __future__ import annotations

import pytest
import torch
import zmq

from myelin.runtime.messages import Message, decode, encode

ALIGN = 64


def message(*tensors):
    return Message(
        "activation", src=1, step=0, microbatch=0, stage=1, tensors=list(tensors), meta={}
    )


@pytest.mark.parametrize("offset", [0, 2, 4, 8, 16, 32, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_a_frame_at_any_offset_decodes_to_an_aligned_tensor(offset, dtype):
    sent = torch.arange(24).to(dtype).reshape(2, 12)
    header, frame = encode(message(sent))
    raw = bytes(frame)
    backing = torch.zeros(offset + len(raw) + ALIGN, dtype=torch.uint8)  # 64-byte aligned
    backing[offset : offset + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    view = memoryview(backing.numpy())[offset : offset + len(raw)]
    (got,) = decode([header, view]).tensors
    assert got.data_ptr() % ALIGN == 0
    assert torch.equal(got, sent)


def test_small_messages_through_zeromq_arrive_aligned():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://align")
        push.connect("inproc://align")
        pull.rcvtimeo = 5000
        unaligned = []
        for rows in range(1, 40):
            sent = torch.randn(rows, 3)
            push.send_multipart(encode(message(sent)), copy=False)
            (got,) = decode(pull.recv_multipart(copy=False)).tensors
            assert torch.equal(got, sent)
            if got.data_ptr() % ALIGN:
                unaligned.append((rows, got.data_ptr() % ALIGN))
        assert unaligned == []
    finally:
        for s in (pull, push):
            s.close(linger=0)
        ctx.term()
