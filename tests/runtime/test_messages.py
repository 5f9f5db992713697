"""The wire codec: round trips, zero-copy frames, strict rejection, fuzzing.

Run: python3 -m pytest tests/runtime/test_messages.py -q
"""

from __future__ import annotations

import array
import dataclasses
import gc
import math
import warnings
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from myelin.errors import MessageError, MyelinError
from myelin.runtime.messages import (
    COPY_BELOW,
    DTYPES,
    KINDS,
    PROTOCOL_VERSION,
    Message,
    MessageLimits,
    decode,
    encode,
)

HEADER_INTS = ("src", "step", "microbatch", "stage")
HEADER_FIELDS = ("version", "kind", *HEADER_INTS, "tensors", "meta")
INT_MAX = 2**63 - 1
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- helpers


def _message(*tensors: torch.Tensor, kind: str = "activation", meta: Any = None, **ints: Any):
    fields = {name: ints.get(name, i + 1) for i, name in enumerate(HEADER_INTS)}
    return Message(kind, tensors=list(tensors), meta={} if meta is None else meta, **fields)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's contiguous values as raw bytes, so NaNs and -0.0 compare exactly."""
    # clone, not contiguous(): a "contiguous" tensor may keep odd strides on size-1 dims
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _address(buf: Any) -> int:
    """Address of a buffer's first byte (torch.frombuffer shares memory by contract)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers warn
        return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


def assert_same_message(got: Message, want: Message) -> None:
    assert isinstance(got, Message)
    for name in ("kind", *HEADER_INTS):
        assert getattr(got, name) == getattr(want, name), name
        assert type(getattr(got, name)) is type(getattr(want, name)), name
    assert got.meta == want.meta
    assert msgpack.packb(got.meta) == msgpack.packb(want.meta)  # int vs float, -0.0
    assert len(got.tensors) == len(want.tensors)
    for g, w in zip(got.tensors, want.tensors, strict=True):
        assert g.dtype == w.dtype
        assert g.shape == w.shape
        assert g.device.type == "cpu"
        assert g.is_contiguous()
        assert torch.equal(_bits(g), _bits(w))


def assert_aliases(got: Message, frames: list[Any]) -> None:
    """Each decoded tensor from COPY_BELOW bytes shares its frame's memory, unless the frame
    is not 64-byte aligned: then it is a copy in aligned memory (issue 17.8), as every
    smaller frame is (copying a few KiB costs less than wrapping them, issue 11.4)."""
    for t, frame in zip(got.tensors, frames[1:], strict=True):
        if t.numel() == 0:
            continue
        address = _address(getattr(frame, "buffer", frame))  # zmq.Frame has .buffer
        big = t.numel() * t.element_size() >= COPY_BELOW
        if address % 64 == 0 and big:
            assert t.data_ptr() == address
        else:
            assert t.data_ptr() != address
            assert t.data_ptr() % 64 == 0


_PAYLOAD = bytes(range(24))  # the bytes of a (2, 3) float32 tensor
_DROP = object()  # a field value that removes the field


def _spec(**changes: Any) -> dict[str, Any]:
    spec = {"dtype": "float32", "shape": [2, 3], "nbytes": 24}
    spec.update(changes)
    return {k: v for k, v in spec.items() if v is not _DROP}


def _header(**changes: Any) -> dict[str, Any]:
    header = {
        "version": PROTOCOL_VERSION,
        "kind": "activation",
        "src": 0,
        "step": 1,
        "microbatch": 2,
        "stage": 3,
        "tensors": [_spec()],
        "meta": {},
    }
    header.update(changes)
    return {k: v for k, v in header.items() if v is not _DROP}


def _wire(header: Any, *payloads: bytes) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def _nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


@pytest.fixture(scope="module")
def zmq_pair():
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for sock in (tx, rx):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
    tx.bind("inproc://test-messages")
    rx.connect("inproc://test-messages")
    yield tx, rx
    tx.close()
    rx.close()
    ctx.term()


def _through_zmq(pair, frames: list[Any]) -> list[zmq.Frame]:
    tx, rx = pair
    tx.send_multipart(frames, copy=False)
    received = rx.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in received)
    return received


# ---------------------------------------------------------------- strategies

_DTYPES = list(DTYPES.values())
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_IDS = st.integers(0, INT_MAX)


@st.composite
def tensors(draw, max_size: int = 3, min_size: int = 0) -> torch.Tensor:
    """A tensor of any wire dtype with random bits (NaNs included), maybe non-contiguous."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(min_size, max_size), max_size=5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    if dtype is torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=gen)
        t = raw.to(torch.uint8).view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif layout == "strided":
        t = torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]  # every other element
    return t


_META_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)


def _meta_values(depth: int):
    if depth == 0:
        return _META_LEAVES
    inner = _meta_values(depth - 1)
    return (
        _META_LEAVES
        | st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    )


metas = st.dictionaries(st.text(max_size=8), _meta_values(3), max_size=4)


@st.composite
def messages(draw, max_tensors: int = 4, min_size: int = 0) -> Message:
    return Message(
        kind=draw(st.sampled_from(KINDS)),
        src=draw(_IDS),
        step=draw(_IDS),
        microbatch=draw(_IDS),
        stage=draw(_IDS),
        tensors=draw(st.lists(tensors(min_size=min_size), max_size=max_tensors)),
        meta=draw(metas),
    )


# ---------------------------------------------------------------- round trips

_COPIES = {
    "as-is": lambda frames: frames,
    "bytes": lambda frames: [bytes(f) for f in frames],
    "bytearray": lambda frames: [bytearray(f) for f in frames],
    "memoryview": lambda frames: [memoryview(bytes(f)) for f in frames],
}


@pytest.mark.parametrize("copy", list(_COPIES))
@settings(FUZZ)
@given(message=messages())
def test_round_trip(copy, message):
    frames = _COPIES[copy](encode(message))
    assert len(frames) == 1 + len(message.tensors)
    got = decode(frames)
    assert_same_message(got, message)
    assert_aliases(got, frames)


@settings(FUZZ)
@given(message=messages())
def test_round_trip_through_zmq_frames(zmq_pair, message):
    received = _through_zmq(zmq_pair, encode(message))
    got = decode(received)
    assert_same_message(got, message)
    assert_aliases(got, received)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_special_floats_keep_their_bits(dtype):
    values = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40, -1.5]
    t = torch.tensor(values, dtype=dtype)
    got = decode([bytes(f) for f in encode(_message(t))]).tensors[0]
    assert torch.equal(_bits(got), _bits(t))


def test_header_fields_at_their_limits_round_trip():
    message = _message(kind="control", src=0, step=INT_MAX, microbatch=0, stage=INT_MAX)
    assert_same_message(decode(encode(message)), message)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips_without_tensors(kind):
    message = _message(kind=kind, meta={"loss": 1.25, "ok": True, "tags": ["a", b"b", None]})
    frames = encode(message)
    assert len(frames) == 1
    assert_same_message(decode(frames), message)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),
        lambda: torch.arange(24, dtype=torch.int32).reshape(2, 3, 4).permute(2, 0, 1),
        lambda: torch.arange(20, dtype=torch.int64)[::3],
        lambda: torch.arange(30.0, dtype=torch.float16).reshape(5, 6)[1:4, 2:5],
        lambda: torch.arange(4.0).expand(3, 4),
        lambda: torch.tensor([[True, False, True], [False, False, True]]).t(),
    ],
    ids=["transposed", "permuted", "step-sliced", "block", "expanded", "bool"],
)
def test_non_contiguous_tensors_encode_their_values(make):
    t = make()
    assert not t.is_contiguous()
    got = decode([bytes(f) for f in encode(_message(t))]).tensors[0]
    assert got.is_contiguous()
    assert got.shape == t.shape
    assert torch.equal(_bits(got), _bits(t.contiguous()))


def test_place_and_fetch_carry_tensors_outside_the_frames():
    store: dict[int, torch.Tensor] = {}
    calls = []

    def place(i, t):
        if i % 2:
            return None  # odd tensors travel inline
        store[i] = t.clone()
        return [i, 42]

    def fetch(src, loc, dtype, shape, nbytes):
        calls.append((src, loc, dtype, shape, nbytes))
        return store[loc[0]]

    sent = [torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.int8), torch.tensor(True)]
    message = _message(*sent, src=5)
    frames = encode(message, place=place)
    assert len(frames) == 2  # header + the one inline tensor
    specs = msgpack.unpackb(frames[0])["tensors"]
    assert [s.get("shm") for s in specs] == [[0, 42], None, [2, 42]]
    assert_same_message(decode([bytes(f) for f in frames], fetch=fetch), message)
    assert calls == [
        (5, [0, 42], torch.float32, (2, 3), 24),
        (5, [2, 42], torch.bool, (), 1),
    ]


def test_decode_accepts_everything_exactly_at_the_limits():
    header = _header(tensors=[_spec(), _spec()])
    frames = _wire(header, _PAYLOAD, _PAYLOAD)
    limits = MessageLimits(
        max_header_bytes=len(frames[0]),
        max_tensors=2,
        max_ndim=2,
        max_tensor_bytes=24,
        max_message_bytes=48,
    )
    got = decode(frames, limits=limits)
    assert [t.shape for t in got.tensors] == [(2, 3), (2, 3)]


def test_meta_nested_eight_deep_is_accepted():
    meta = {"a": _nested(7)}  # the innermost 0 sits at depth 8
    assert decode(_wire(_header(meta=meta), _PAYLOAD)).meta == meta


# ---------------------------------------------------------------- zero copy


def test_encode_sends_contiguous_tensors_without_a_copy():
    t = torch.arange(6, dtype=torch.float32)
    frame = encode(_message(t))[1]
    assert _address(frame) == t.data_ptr()
    t[0] = 7.0
    assert bytes(frame[:4]) == bytes(torch.tensor([7.0]).view(torch.uint8).tolist())


def test_encoded_frames_keep_their_contiguous_copy_alive():
    frames = encode(_message(torch.arange(64.0).reshape(8, 8).t()))
    expected = torch.arange(64.0).reshape(8, 8).t().contiguous()
    gc.collect()
    _ = [torch.full((64,), -1.0) for _ in range(100)]  # reuse any freed memory
    got = decode([bytes(f) for f in frames]).tensors[0]
    assert torch.equal(got, expected)


def test_decoded_tensors_alias_aligned_frames():
    rows = COPY_BELOW // 12 + 1  # (rows, 3) float32: over COPY_BELOW bytes, aliased
    backing = torch.zeros(rows * 12, dtype=torch.uint8)  # 64-byte aligned
    buf = memoryview(backing.numpy())
    header = _header(tensors=[_spec(shape=[rows, 3], nbytes=rows * 12)])
    t = decode(_wire(header, buf)).tensors[0]
    assert t.data_ptr() == backing.data_ptr()
    backing[0:4] = torch.tensor([2.5]).view(torch.uint8)
    assert t[0, 0].item() == 2.5  # a write to the frame shows in the tensor


def test_small_frames_are_copied_even_when_aligned():
    backing = torch.frombuffer(bytearray(_PAYLOAD), dtype=torch.uint8).clone()  # 64-aligned
    t = decode(_wire(_header(), memoryview(backing.numpy()))).tensors[0]
    assert t.data_ptr() != backing.data_ptr() and t.data_ptr() % 64 == 0
    assert bytes(_bits(t).tolist()) == _PAYLOAD
    backing[0:4] = torch.tensor([2.5]).view(torch.uint8)
    assert t[0, 0].item() != 2.5  # a copy: later writes to the frame do not show


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_unaligned_frames_are_copied_to_aligned_memory(dtype):
    n = 8 * dtype.itemsize
    raw = bytearray(range(1, n + 2))
    frame = memoryview(raw)[1:]  # off by one byte from an aligned allocation
    header = _header(tensors=[_spec(dtype=_DTYPE_NAMES[dtype], shape=[8], nbytes=n)])
    if dtype is torch.bool:
        frame[:] = bytes([1, 0] * 4)
    t = decode(_wire(header, frame)).tensors[0]
    assert t.data_ptr() % 64 == 0  # even bytes: kernels take other paths on unaligned data
    assert bytes(_bits(t).tolist()) == bytes(frame)
    assert t.data_ptr() != _address(frame)  # a copy


def test_large_zmq_frames_arrive_without_a_copy(zmq_pair):
    sent = [torch.randn(256, 1024), torch.arange(2**17, dtype=torch.int64)]
    received = _through_zmq(zmq_pair, encode(_message(*sent)))
    got = decode(received)
    assert_aliases(got, received)
    del received
    gc.collect()
    _ = [torch.full((256, 1024), -1.0) for _ in range(4)]  # reuse any freed memory
    for g, w in zip(got.tensors, sent, strict=True):
        assert torch.equal(g, w)  # the tensors keep their frames alive


# ---------------------------------------------------------------- rejection


def _case(id: str, frames: list[Any], field: str, **limits: int):
    return pytest.param(frames, field, MessageLimits(**limits), id=id)


def _bad_header(**changes: Any) -> list[bytes]:
    """Frames of the one-tensor message with header fields changed."""
    return _wire(_header(**changes), _PAYLOAD)


def _bad_spec(**changes: Any) -> list[bytes]:
    """Frames of the one-tensor message with its tensor spec changed."""
    return _bad_header(tensors=[_spec(**changes)])


_GOOD = _bad_header()
_TWO = _header(tensors=[_spec(), _spec()])

REJECTED = [
    # framing
    _case("no frames", [], "frames"),
    _case("header frame not bytes", [5], "frames"),
    _case("tensor frame not bytes", [_GOOD[0], "text"], "frames"),
    _case("garbage", [b"\xc1\x00garbage"], "header"),
    _case("empty header frame", [b""], "header"),
    _case("bytes after header", [_GOOD[0] + b"\x00", _PAYLOAD], "header"),
    _case("truncated header", [_GOOD[0][:-3], _PAYLOAD], "header"),
    _case("header is a list", _wire([1, 2]), "header"),
    _case("header is an int", _wire(7), "header"),
    _case("header nested 10000 deep", [b"\x91" * 10_000 + b"\xc0"], "header"),
    _case("missing tensor frame", _GOOD[:1], "tensors"),
    _case("missing second frame", _wire(_TWO, _PAYLOAD), "tensors"),
    _case("extra frame", [*_GOOD, b""], "tensors"),
    _case("truncated tensor frame", [_GOOD[0], _PAYLOAD[:-1]], "tensors[0].nbytes"),
    _case("long tensor frame", [_GOOD[0], _PAYLOAD + b"\x00"], "tensors[0].nbytes"),
    _case("empty tensor frame", [_GOOD[0], b""], "tensors[0].nbytes"),
    _case("bad second frame", _wire(_TWO, _PAYLOAD, _PAYLOAD[:8]), "tensors[1].nbytes"),
    _case("header overstates", _bad_spec(shape=[2, 4], nbytes=32), "tensors[0].nbytes"),
    _case("header understates", _bad_spec(shape=[2, 2], nbytes=16), "tensors[0].nbytes"),
    _case("nbytes larger than shape", _bad_spec(nbytes=28), "tensors[0].nbytes"),
    _case("nbytes smaller than shape", _bad_spec(nbytes=20), "tensors[0].nbytes"),
    _case("shape of another dtype", _bad_spec(dtype="float64"), "tensors[0].nbytes"),
    # header fields
    *[_case(f"version {v!r}", _bad_header(version=v), "version") for v in (2, 0, True, 1.0, "1")],
    *[_case(f"kind {v!r}", _bad_header(kind=v), "kind") for v in ("forward", "", b"control", 1)],
    _case("kind None", _bad_header(kind=None), "kind"),
    _case("kind a list", _bad_header(kind=["control"]), "kind"),
    _case("unknown header field", _bad_header(extra=1), "extra"),
    *[_case(f"meta {v!r}", _bad_header(meta=v), "meta") for v in ([], None, "x", 1)],
    _case("ext type in meta", _bad_header(meta={"x": msgpack.ExtType(5, b"x")}), "header"),
    _case("ext type in shape", _bad_spec(shape=[msgpack.ExtType(1, b"")]), "header"),
    _case("timestamp in meta", _bad_header(meta={"when": msgpack.Timestamp(1)}), "meta.when"),
    _case("timestamp as src", _bad_header(src=msgpack.Timestamp(1)), "src"),
    _case("meta nested too deep", _bad_header(meta={"a": _nested(8)}), "meta.a" + "[0]" * 8),
    _case("int key in meta", _bad_header(meta={1: "x"}), "header"),
    _case("float key in meta", _bad_header(meta={1.5: "x"}), "header"),
    _case("bytes key in meta", _bad_header(meta={b"k": 1}), "meta"),
    _case("bytes key in nested meta", _bad_header(meta={"a": [{b"k": 1}]}), "meta.a[0]"),
    _case("int key in header", _wire({**_header(), 1: 2}), "header"),
    _case("int key in tensor spec", _bad_header(tensors=[{**_spec(), 3: 4}]), "header"),
    # tensor specs
    *[_case(f"tensors {v!r}", _bad_header(tensors=v), "tensors") for v in ({}, None, "t", 1)],
    _case("spec not a map", _bad_header(tensors=[[24]]), "tensors[0]"),
    *[
        _case(f"missing {name}", _bad_spec(**{name: _DROP}), f"tensors[0].{name}")
        for name in ("dtype", "shape", "nbytes")
    ],
    _case("unknown tensor field", _bad_spec(stride=[3, 1]), "tensors[0].stride"),
    *[
        _case(f"dtype {v!r}", _bad_spec(dtype=v), "tensors[0].dtype")
        for v in ("complex64", "int16", "float", "torch.float32", "", 5, None, b"float32")
    ],
    *[
        _case(f"shape {v!r}", _bad_spec(shape=v), "tensors[0].shape")
        for v in (6, "2x3", None, {"0": 2})
    ],
    *[
        _case(f"shape dim {v!r}", _bad_spec(shape=[2, v]), "tensors[0].shape[1]")
        for v in (-3, True, 3.0, "3", None, INT_MAX + 1)
    ],
    *[
        _case(f"nbytes {v!r}", _bad_spec(nbytes=v), "tensors[0].nbytes")
        for v in (-24, True, 24.0, "24", None, 2**64 - 1)
    ],
    _case("shm without fetch", _wire(_header(tensors=[_spec(shm=[1, 2])])), "tensors[0].shm"),
    *[
        _case(f"shm {v!r}", _bad_spec(shm=v), "tensors[0].shm")
        for v in ([], "seg", 3, False, {"a": 1})
    ],
    _case("shm negative", _bad_spec(shm=[1, -1]), "tensors[0].shm[1]"),
    _case("shm bool", _bad_spec(shm=[True]), "tensors[0].shm[0]"),
    # limits
    _case("header over limit", _GOOD, "header", max_header_bytes=len(_GOOD[0]) - 1),
    _case("header over default limit", _bad_header(meta={"pad": "x" * 2**16}), "header"),
    _case("too many tensors", _wire(_TWO, _PAYLOAD, _PAYLOAD), "tensors", max_tensors=1),
    _case("too many dims", _GOOD, "tensors[0].shape", max_ndim=1),
    _case("too many dims by default", _bad_spec(shape=[1] * 33, nbytes=4), "tensors[0].shape"),
    _case("tensor over limit", _GOOD, "tensors[0].nbytes", max_tensor_bytes=23),
    _case(
        "second tensor over limit",
        _bad_header(tensors=[_spec(shape=[1], nbytes=4), _spec()]),
        "tensors[1].nbytes",
        max_tensor_bytes=23,
    ),
    _case("message over limit", _wire(_TWO, _PAYLOAD, _PAYLOAD), "tensors", max_message_bytes=47),
]


@pytest.mark.parametrize(("frames", "field", "limits"), REJECTED)
def test_decode_rejects(frames, field, limits):
    with pytest.raises(MessageError) as info:
        decode(frames, limits=limits)
    assert info.value.field == field, info.value


@pytest.mark.parametrize("name", HEADER_FIELDS)
def test_decode_rejects_a_missing_header_field(name):
    with pytest.raises(MessageError) as info:
        decode(_wire(_header(**{name: _DROP}), _PAYLOAD))
    assert info.value.field == name


@pytest.mark.parametrize("value", [-1, True, False, 1.0, "1", None, [1], INT_MAX + 1, 2**64 - 1])
@pytest.mark.parametrize("name", HEADER_INTS)
def test_decode_rejects_a_bad_header_int(name, value):
    with pytest.raises(MessageError) as info:
        decode(_wire(_header(**{name: value}), _PAYLOAD))
    assert info.value.field == name


# ---------------------------------------------------------------- encode errors

ENCODE_REJECTED = [
    pytest.param(_message(kind="forward"), "kind", id="unknown kind"),
    pytest.param(_message(kind=None), "kind", id="kind None"),
    *[
        pytest.param(_message(**{name: value}), name, id=f"{name} {value!r}")
        for name in HEADER_INTS
        for value in (-1, True, 1.0, "1", INT_MAX + 1)
    ],
    pytest.param(_message(meta=[("a", 1)]), "meta", id="meta a list"),
    pytest.param(Message("activation", 0, 0, 0, 0, [[1.0, 2.0]]), "tensors[0]", id="list tensor"),
    pytest.param(_message(torch.ones(1), 3.0), "tensors[1]", id="float tensor"),
    *[
        pytest.param(_message(torch.zeros(2, dtype=d)), "tensors[0].dtype", id=str(d))
        for d in (torch.complex64, torch.int16, torch.uint16, torch.float8_e4m3fn)
    ],
    pytest.param(_message(torch.empty(2, device="meta")), "tensors[0].device", id="meta device"),
]


@pytest.mark.parametrize(("message", "field"), ENCODE_REJECTED)
def test_encode_rejects(message, field):
    with pytest.raises(MessageError) as info:
        encode(message)
    assert info.value.field == field


def test_encode_rejects_meta_that_is_not_a_map():
    message = _message()
    message.meta = None
    with pytest.raises(MessageError) as info:
        encode(message)
    assert info.value.field == "meta"


# ---------------------------------------------------------------- limits and errors


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8", None])
@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(MessageLimits)])
def test_limits_reject_non_positive_ints(name, value):
    with pytest.raises(ValueError, match=f"MessageLimits.{name}"):
        MessageLimits(**{name: value})


def test_limits_are_frozen_and_keyword_only():
    limits = MessageLimits(max_tensors=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_tensors = 4
    with pytest.raises(TypeError):
        MessageLimits(1024)


def test_message_error_names_the_field():
    err = MessageError("tensors[0].dtype", "'complex64' is not allowed")
    assert (err.field, err.problem) == ("tensors[0].dtype", "'complex64' is not allowed")
    assert isinstance(err, MyelinError) and isinstance(err, ValueError)
    assert "tensors[0].dtype" in str(err) and "complex64" in str(err)


# ---------------------------------------------------------------- fuzzing


def _decode_or_reject(frames: list[Any]) -> None:
    """Decode, allowing MessageError only; a decoded message must be well formed."""
    try:
        message = decode(frames)
    except MessageError as err:
        assert isinstance(err.field, str)
        return
    assert message.kind in KINDS
    for t in message.tensors:
        assert t.dtype in _DTYPES and t.is_contiguous()


@settings(FUZZ, max_examples=800)
@given(frames=st.lists(st.binary(max_size=48), max_size=4))
def test_fuzz_random_frames(frames):
    _decode_or_reject(frames)


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=gen)
    return raw.to(torch.uint8).view(dtype).reshape(shape)


# Valid messages to mutate, fixed so that examples go to mutations, not to generation.
_SHAPES = [(), (3,), (2, 3), (1, 2, 1, 2, 1), (4, 1)]
_SAMPLES = [
    _message(kind="control"),
    _message(kind="gradient", meta={"loss": 0.5, "tags": ["a", b"b"], "n": {"x": None}}),
    *[_message(_random_tensor(d, _SHAPES[i % 5], i), meta={"i": i}) for i, d in enumerate(_DTYPES)],
    _message(*[_random_tensor(d, (2, 2), 9) for d in _DTYPES[:3]], src=INT_MAX),
]
_SAMPLE_FRAMES = [[bytes(f) for f in encode(m)] for m in _SAMPLES]
_SAMPLES_WITH_EMPTY = [
    *_SAMPLE_FRAMES,
    [bytes(f) for f in encode(_message(torch.empty(0, 3), torch.ones(2, 0, dtype=torch.int8)))],
]

_OPS = st.tuples(
    st.sampled_from(["flip", "truncate", "splice", "drop", "dup", "insert", "overwrite"]),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
    st.binary(max_size=12),
)


def _mutate(frames: list[bytes], ops: list[tuple]) -> list[bytes]:
    out = [bytearray(f) for f in frames]
    for op, a, b, c, blob in ops:
        if op == "insert" or not out:
            out.insert(a % (len(out) + 1), bytearray(blob))
            continue
        f = out[a % len(out)]
        if op == "flip" and f:
            f[b % len(f)] ^= 1 << (c % 8)
        elif op == "truncate":
            del f[b % (len(f) + 1) :]
        elif op == "splice":  # copy a piece of one frame into another
            src = out[c % len(out)]
            start = b % (len(src) + 1)
            piece = src[start : start + 1 + c % 32]
            pos = (b + c) % (len(f) + 1)
            f[pos:pos] = piece
        elif op == "drop":
            out.remove(f)
        elif op == "dup":
            out.insert(b % (len(out) + 1), bytearray(f))
        elif op == "overwrite" and f:
            pos = b % len(f)
            f[pos : pos + len(blob)] = blob
    return [bytes(f) for f in out]


@settings(FUZZ, max_examples=1200)
@given(frames=st.sampled_from(_SAMPLES_WITH_EMPTY), ops=st.lists(_OPS, min_size=1, max_size=4))
def test_fuzz_mutated_frames(frames, ops):
    _decode_or_reject(_mutate(frames, ops))


_WIRE_INTS = st.sampled_from([-(2**63), -1, 0, 1, 2, 4, 24, 2**31, INT_MAX, 2**63, 2**64 - 1])
_WIRE_NAMES = st.sampled_from([*HEADER_FIELDS, "dtype", "shape", "nbytes", "shm", *DTYPES, *KINDS])
_WIRE_LEAVES = (
    st.none()
    | st.booleans()
    | _WIRE_INTS
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | _WIRE_NAMES
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1))
)
# Keys are strings only: bytes keys next to string keys hit a known bug (see below).
_WIRE_VALUES = st.recursive(
    _WIRE_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_WIRE_NAMES | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)


def _paths(value: Any, path: tuple = ()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*path, i))


@st.composite
def mutated_headers(draw) -> list[bytes]:
    """A valid message whose header has one value replaced, deleted or added.

    One edit only, of messages without empty tensors: two edits can build an empty
    tensor with an overflowing shape, a known bug documented below.
    """
    frames = draw(st.sampled_from(_SAMPLE_FRAMES))
    header = msgpack.unpackb(frames[0])
    path = draw(st.sampled_from(list(_paths(header))))
    op, value = draw(st.sampled_from(["replace", "delete", "add"])), draw(_WIRE_VALUES)
    if not path:
        header = value
    else:
        parent = header
        for key in path[:-1]:
            parent = parent[key]
        if op == "replace":
            parent[path[-1]] = value
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(_WIRE_NAMES | st.text(max_size=6))] = value
        else:
            parent.append(value)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


@settings(FUZZ, max_examples=800)
@given(frames=mutated_headers())
def test_fuzz_mutated_headers(frames):
    _decode_or_reject(frames)


@pytest.mark.slow
@settings(FUZZ, max_examples=20_000)
@given(
    frames=st.lists(st.binary(max_size=64), max_size=5)
    | mutated_headers()
    | st.builds(
        _mutate, st.sampled_from(_SAMPLES_WITH_EMPTY), st.lists(_OPS, min_size=1, max_size=6)
    )
)
def test_fuzz_tens_of_thousands(frames):
    """The long run (-m slow): 20,000 random, mutated and header-mutated messages."""
    _decode_or_reject(frames)


# ------------------------------------------------- regressions (bugs this suite found)


@pytest.mark.parametrize("where", ["header", "tensor spec"])
def test_decode_rejects_mixed_str_and_bytes_unknown_keys(where):
    if where == "header":
        header = {**_header(), b"x": 1, "y": 2}
    else:
        header = _header(tensors=[{**_spec(), b"x": 1, "y": 2}])
    with pytest.raises(MessageError):
        decode(_wire(header, _PAYLOAD))


def test_decode_names_a_bytes_header_key_with_a_str_field():
    with pytest.raises(MessageError) as info:
        decode(_wire({**_header(), b"x": 1}, _PAYLOAD))
    assert isinstance(info.value.field, str)


@pytest.mark.parametrize("shape", [[0, INT_MAX, INT_MAX], [2**62, 4, 0]])
def test_decode_rejects_empty_shapes_that_overflow(shape):
    header = _header(tensors=[_spec(shape=shape, nbytes=0)])
    with pytest.raises(MessageError) as info:
        decode(_wire(header, b""))
    assert info.value.field.startswith("tensors[0].shape")


@pytest.mark.parametrize("fmt", ["B", "i"])
def test_decode_rejects_non_contiguous_buffers(fmt):
    view = memoryview(array.array(fmt, range(48)))[::2]
    header = _header(tensors=[_spec(dtype="uint8", shape=[view.nbytes], nbytes=view.nbytes)])
    with pytest.raises(MessageError) as info:
        decode([_wire(header)[0], view])
    assert info.value.field == "frames"


def test_encode_sends_the_value_of_negative_views():
    t = torch.tensor([1 + 2j]).conj().imag  # contiguous, is_neg() is True
    assert t.is_contiguous() and t.is_neg()
    got = decode(encode(_message(t))).tensors[0]
    assert got.tolist() == [-2.0]


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize(
    "make",
    [lambda: torch.sparse_coo_tensor([[0]], [1.0], (3,)), lambda: torch.zeros(2).to_mkldnn()],
    ids=["sparse", "mkldnn"],
)
def test_encode_rejects_non_strided_tensors(make):
    with pytest.raises(MessageError) as info:
        encode(_message(make()))
    assert info.value.field.startswith("tensors[0]")


@pytest.mark.parametrize(
    "meta",
    [{1: "x"}, {"a": _nested(8)}, {"a": object()}, {"a": 2**64}, {"a": torch.ones(1)}],
    ids=["int key", "too deep", "object", "too big int", "tensor"],
)
def test_encode_rejects_meta_the_decoder_would_reject(meta):
    with pytest.raises(MessageError) as info:
        encode(_message(meta=meta))
    assert info.value.field.startswith("meta")
