"""The wire format: one msgpack header frame, then one raw frame per tensor.

Decoding is strict and never unpickles: every field is checked against the
header schema and the configured limits, and a violation is a `MessageError`
naming the field. Tensors are sent without a copy from contiguous host memory
and received with `torch.frombuffer` over the frame's own buffer.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from myelin.errors import ConfigError, MessageError

__all__ = [
    "PROTOCOL_VERSION",
    "KINDS",
    "DTYPES",
    "Message",
    "MessageLimits",
    "encode",
    "decode",
    "tensor_frame",
    "COPY_BELOW",
]

PROTOCOL_VERSION = 1
KINDS = ("activation", "gradient", "tied", "control")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_HEADER_FIELDS = ("version", "kind", "src", "step", "microbatch", "stage", "tensors", "meta")
_HEADER_SET = frozenset(_HEADER_FIELDS)
_HEADER_INTS = ("src", "step", "microbatch", "stage")
_TENSOR_FIELDS = frozenset(("dtype", "shape", "nbytes", "shm"))
_TENSOR_REQUIRED = frozenset(("dtype", "shape", "nbytes"))
_SCALARS = frozenset((bool, float, str, bytes, type(None)))
_META_MAX_DEPTH = 8
_INT_MAX = 2**63 - 1


@dataclass(slots=True)
class Message:
    """One point-to-point message: who sent it, for which operation, and its tensors."""

    kind: str
    src: int
    step: int
    microbatch: int
    stage: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class MessageLimits:
    """Upper bounds a decoder enforces, so a peer cannot make a rank allocate without bound."""

    max_header_bytes: int = 64 * 1024
    max_tensors: int = 256
    max_ndim: int = 32
    max_tensor_bytes: int = 8 * 2**30
    max_message_bytes: int = 16 * 2**30

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"MessageLimits.{name}={value!r} must be an int >= 1")


DEFAULT_LIMITS = MessageLimits()

# Where a tensor lives when it travels outside the frames (shared memory): the
# transport supplies `place` on encode and `fetch` on decode.
Place = Callable[[int, torch.Tensor], "list[int] | None"]
Fetch = Callable[[int, list[int], torch.dtype, tuple[int, ...], int], torch.Tensor]


def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor that keeps the tensor alive."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array._owner = tensor  # the view must not outlive the tensor's storage
    return memoryview(array).cast("B")


def encode(message: Message, place: Place | None = None) -> list[memoryview | bytes]:
    """Encode a message into frames: a msgpack header, then one frame per tensor."""
    _check_outgoing(message)
    specs: list[dict[str, Any]] = []
    frames: list[memoryview | bytes] = []
    for i, t in enumerate(message.tensors):
        if t.is_neg() or t.is_conj():
            t = t.resolve_conj().resolve_neg()  # lazy sign bits are not in the bytes
        if not t.is_contiguous():
            t = t.contiguous()
        spec: dict[str, Any] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size(),
        }
        loc = place(i, t) if place is not None else None
        if loc is not None:
            spec["shm"] = [_check_int(f"tensors[{i}].shm", v) for v in loc]
        else:
            frames.append(tensor_frame(t))
        specs.append(spec)
    header = {
        "version": PROTOCOL_VERSION,
        "kind": message.kind,
        "src": message.src,
        "step": message.step,
        "microbatch": message.microbatch,
        "stage": message.stage,
        "tensors": specs,
        "meta": message.meta,
    }
    return [msgpack.packb(header, use_bin_type=True), *frames]


def decode(
    frames: Sequence[Any],
    limits: MessageLimits = DEFAULT_LIMITS,
    fetch: Fetch | None = None,
) -> Message:
    """Decode frames into a Message, or raise `MessageError` naming the bad field.

    Frames may be bytes, memoryviews or `zmq.Frame`s; tensors alias the frames' buffers from
    `COPY_BELOW` bytes (smaller ones are copied).
    """
    if len(frames) == 0:
        raise MessageError("frames", "no frames (expected a header frame)")
    header = _unpack_header(_buffer(frames[0]), limits)
    specs = _check_tensor_specs(header["tensors"], limits)
    inline = [s for s in specs if s[3] is None]
    if len(frames) != 1 + len(inline):
        raise MessageError(
            "tensors",
            f"header lists {len(inline)} inline tensors but {len(frames) - 1} frames came",
        )
    tensors: list[torch.Tensor] = []
    next_frame = 1
    for i, (dtype, shape, nbytes, shm) in enumerate(specs):
        if shm is not None:
            if fetch is None:
                raise MessageError(f"tensors[{i}].shm", "shared memory is not enabled here")
            t = fetch(header["src"], shm, dtype, shape, nbytes)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise MessageError(f"tensors[{i}].shm", "shared memory returned the wrong tensor")
            tensors.append(t)
            continue
        buf = _buffer(frames[next_frame])
        next_frame += 1
        if buf.nbytes != nbytes:
            raise MessageError(
                f"tensors[{i}].nbytes", f"header says {nbytes} bytes, frame has {buf.nbytes}"
            )
        t = _tensor_from(buf, dtype, shape)
        if dtype == torch.bool and t.numel() and int(t.view(torch.uint8).max()) > 1:
            raise MessageError(f"tensors[{i}]", "bool tensor holds bytes other than 0 and 1")
        tensors.append(t)
    return Message(
        kind=header["kind"],
        src=header["src"],
        step=header["step"],
        microbatch=header["microbatch"],
        stage=header["stage"],
        tensors=tensors,
        meta=header["meta"],
    )


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        view = memoryview(buf)
    except TypeError:
        raise MessageError("frames", f"frame of type {type(frame).__name__} is not bytes") from None
    if not view.c_contiguous:
        raise MessageError("frames", "frame buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


_ALIGN = 64  # bytes; torch's CPU allocator and the shared-memory slots (shm.ALIGN) align so
COPY_BELOW = 64 * 1024  # bytes; a smaller frame is copied, which costs less than wrapping it


def _tensor_from(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = buf.nbytes
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if nbytes < COPY_BELOW:
        # One copy into torch's own 64-byte aligned memory: cheaper than wrapping a small
        # frame (and its read-only warning), and aligned wherever ZeroMQ put the bytes.
        t = torch.empty(shape, dtype=dtype)
        tensor_frame(t)[:] = buf
        return t
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only zmq buffers warn; we own them now
        t = torch.frombuffer(buf, dtype=dtype)
    if t.data_ptr() % _ALIGN:
        # A frame where ZeroMQ happened to put it: copy it to aligned memory, as kernels
        # take other paths (and round otherwise) on unaligned inputs, and results must not
        # depend on where bytes land.
        t = t.clone()
    return t.view(shape)


def _unpack_header(buf: memoryview, limits: MessageLimits) -> dict[str, Any]:
    if buf.nbytes > limits.max_header_bytes:
        raise MessageError(
            "header", f"{buf.nbytes} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    try:
        header = msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_reject_ext,
        )
    except MessageError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise MessageError("header", f"not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise MessageError("header", f"expected a map, got {type(header).__name__}")
    if header.keys() != _HEADER_SET:  # the common case costs one comparison
        _check_keys("header", header)
        unknown = sorted(set(header) - _HEADER_SET)
        if unknown:
            raise MessageError(unknown[0], "unknown header field")
        for name in _HEADER_FIELDS:
            if name not in header:
                raise MessageError(name, "missing")
    if header["version"] != PROTOCOL_VERSION or type(header["version"]) is not int:
        raise MessageError(
            "version",
            f"unsupported protocol version {header['version']!r}, "
            f"this build speaks {PROTOCOL_VERSION}",
        )
    if header["kind"] not in KINDS:
        raise MessageError("kind", f"{header['kind']!r} is not one of {', '.join(KINDS)}")
    for name in _HEADER_INTS:
        value = header[name]
        if type(value) is not int or not 0 <= value <= _INT_MAX:
            _check_int(name, value)
    if not isinstance(header["meta"], dict):
        raise MessageError("meta", f"expected a map, got {type(header['meta']).__name__}")
    _check_meta("meta", header["meta"], 0)
    return header


def _check_keys(where: str, mapping: dict) -> None:
    for key in mapping:
        if type(key) is not str:
            raise MessageError(where, f"map key {key!r} is not a string")


def _reject_ext(code: int, data: bytes) -> Any:
    raise MessageError("header", f"msgpack extension type {code} is not allowed")


def _check_int(name: str, value: Any, low: int = 0) -> int:
    if type(value) is not int:
        raise MessageError(name, f"expected an int, got {type(value).__name__}")
    if not low <= value <= _INT_MAX:
        raise MessageError(name, f"{value} is out of range [{low}, {_INT_MAX}]")
    return value


def _check_meta(path: str, value: Any, depth: int) -> None:
    if depth > _META_MAX_DEPTH:
        raise MessageError(path, f"nested deeper than {_META_MAX_DEPTH}")
    kind = type(value)
    if kind is int:
        if not -(2**63) <= value < 2**64:
            raise MessageError(path, f"int {value} does not fit in 64 bits")
        return
    if kind in _SCALARS:
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            if depth >= _META_MAX_DEPTH or type(item) not in _SCALARS:  # ints: their range
                _check_meta(f"{path}[{i}]", item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str:
                raise MessageError(path, f"map key {key!r} is not a string")
            if depth >= _META_MAX_DEPTH or type(item) not in _SCALARS:
                _check_meta(f"{path}.{key}", item, depth + 1)
        return
    raise MessageError(path, f"value of type {type(value).__name__} is not allowed")


def _check_tensor_specs(
    specs: Any, limits: MessageLimits
) -> list[tuple[torch.dtype, tuple[int, ...], int, list[int] | None]]:
    if not isinstance(specs, list):
        raise MessageError("tensors", f"expected a list, got {type(specs).__name__}")
    if len(specs) > limits.max_tensors:
        raise MessageError(
            "tensors", f"{len(specs)} tensors exceeds the limit of {limits.max_tensors}"
        )
    out = []
    total = 0
    for i, spec in enumerate(specs):
        where = f"tensors[{i}]"
        if not isinstance(spec, dict):
            raise MessageError(where, f"expected a map, got {type(spec).__name__}")
        if not (_TENSOR_REQUIRED <= spec.keys() <= _TENSOR_FIELDS):
            _check_keys(where, spec)
            unknown = sorted(set(spec) - _TENSOR_FIELDS)
            if unknown:
                raise MessageError(f"{where}.{unknown[0]}", "unknown tensor field")
            for name in ("dtype", "shape", "nbytes"):
                if name not in spec:
                    raise MessageError(f"{where}.{name}", "missing")
        dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise MessageError(
                f"{where}.dtype", f"{spec['dtype']!r} is not one of {', '.join(DTYPES)}"
            )
        shape = spec["shape"]
        if not isinstance(shape, list):
            raise MessageError(f"{where}.shape", f"expected a list, got {type(shape).__name__}")
        if len(shape) > limits.max_ndim:
            raise MessageError(f"{where}.shape", f"{len(shape)} dims exceeds {limits.max_ndim}")
        numel, extent = 1, 1  # extent ignores zeros, so empty tensors cannot overflow either
        for d, size in enumerate(shape):
            if type(size) is not int or not 0 <= size <= _INT_MAX:
                _check_int(f"{where}.shape[{d}]", size)
            numel *= size
            extent *= max(size, 1)
            if extent > _INT_MAX:
                raise MessageError(f"{where}.shape", f"{shape} has more than 2**63 elements")
        nbytes = spec["nbytes"]
        if type(nbytes) is not int or not 0 <= nbytes <= _INT_MAX:
            _check_int(f"{where}.nbytes", nbytes)
        expected = numel * dtype.itemsize
        if nbytes != expected:
            raise MessageError(
                f"{where}.nbytes",
                f"shape {shape} of {spec['dtype']} is {expected} bytes, header says {nbytes}",
            )
        if nbytes > limits.max_tensor_bytes:
            raise MessageError(
                f"{where}.nbytes", f"{nbytes} exceeds the limit of {limits.max_tensor_bytes}"
            )
        total += nbytes
        if total > limits.max_message_bytes:
            raise MessageError(
                "tensors", f"{total} bytes in all exceeds the limit of {limits.max_message_bytes}"
            )
        shm = spec.get("shm")
        if shm is not None:
            if not isinstance(shm, list) or not shm:
                raise MessageError(f"{where}.shm", "expected a non-empty list of ints")
            for j, v in enumerate(shm):
                _check_int(f"{where}.shm[{j}]", v)
        out.append((dtype, tuple(shape), nbytes, shm))
    return out


def _check_outgoing(message: Message) -> None:
    if message.kind not in KINDS:
        raise MessageError("kind", f"{message.kind!r} is not one of {', '.join(KINDS)}")
    for name in _HEADER_INTS:
        value = getattr(message, name)
        if type(value) is not int or not 0 <= value <= _INT_MAX:
            _check_int(name, value)
    if not isinstance(message.meta, dict):
        raise MessageError("meta", f"expected a dict, got {type(message.meta).__name__}")
    if message.meta:
        _check_meta("meta", message.meta, 0)
    for i, t in enumerate(message.tensors):
        if not isinstance(t, torch.Tensor):
            raise MessageError(f"tensors[{i}]", f"expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_NAMES:
            raise MessageError(
                f"tensors[{i}].dtype", f"{t.dtype} is not one of {', '.join(DTYPES)}"
            )
        if not t.is_cpu:
            raise MessageError(
                f"tensors[{i}].device", f"tensor is on {t.device}; copy it to host memory first"
            )
        if t.layout is not torch.strided or t.is_mkldnn:
            raise MessageError(
                f"tensors[{i}].layout", f"{t.layout} tensors cannot be sent; use .to_dense()"
            )
