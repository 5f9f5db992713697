"""Text every machine has: the Python standard library's own source, as byte-level tokens.

    data = load_stdlib_text(max_bytes=4 << 20)        # train/val split by file, deterministic
    train = Batches(data.train, block_size=128, batch_size=16, seed=0, stream=("train", 0))
    inputs, targets = train.get(step)                 # (B, T) int64 each, targets shifted by one
    trainer.fit(train, steps=100)                     # or as an endless loader

Nothing is downloaded. Files are split into train and validation by a stable hash of
their path relative to the standard library, so the split is the same on every run
and every rank. A batch is a pure function of (seed, stream, index): ranks of one
replica ask for the same stream and get the same batch, replicas ask for their own.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from myelin.errors import ConfigError

__all__ = [
    "VOCAB_SIZE",
    "TextData",
    "Batches",
    "stdlib_root",
    "source_files",
    "is_validation",
    "load_stdlib_text",
    "encode",
    "decode",
]

VOCAB_SIZE = 256  # one token per byte
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


@dataclass(frozen=True, slots=True)
class TextData:
    """Training and validation bytes (uint8 tensors), and the files they were read from."""

    train: torch.Tensor
    val: torch.Tensor
    root: Path
    train_files: int
    val_files: int


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """Every `*.py` under `root`, sorted, leaving out installed packages and test suites."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # prune: never walk into them
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(found)


def _hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and on every run (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def is_validation(relative_path: str, val_fraction: float) -> bool:
    """Whether a file (by its path relative to the library root) belongs to validation."""
    return _hash(relative_path) % 10_000 < round(val_fraction * 10_000)


def _read(files: list[Path], root: Path, budget: int) -> tuple[torch.Tensor, int]:
    """Concatenate files in hash order (a spread over the library) until `budget` bytes.

    Returns the bytes and how many files they came from.
    """
    chunks, size = [], 0
    for path in sorted(files, key=lambda p: _hash(p.relative_to(root).as_posix())):
        if size >= budget:
            break
        data = path.read_bytes() + b"\n"
        chunks.append(data)
        size += len(data)
    blob = b"".join(chunks)[:budget]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), len(chunks)


def load_stdlib_text(
    max_bytes: int = 4 << 20, val_fraction: float = 0.05, root: Path | None = None
) -> TextData:
    """Read up to `max_bytes` of standard-library source, split by file into train and val."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction!r} must be in (0, 1)")
    root = Path(root) if root is not None else stdlib_root()
    files = source_files(root) if root.is_dir() else []
    if not files:
        raise ConfigError(
            f"no Python source files found under {root} (sysconfig's stdlib path); this Python "
            "installation ships without its library sources, so there is no text to train on"
        )
    val = [p for p in files if is_validation(p.relative_to(root).as_posix(), val_fraction)]
    train = [p for p in files if not is_validation(p.relative_to(root).as_posix(), val_fraction)]
    if not val or not train:
        empty = "validation" if not val else "train"
        raise ConfigError(
            f"{len(files)} source files under {root} leave the {empty} split empty at "
            f"val_fraction={val_fraction}"
        )
    val_budget = max(1, int(max_bytes * val_fraction))
    train_bytes, train_files = _read(train, root, max_bytes - val_budget)
    val_bytes, val_files = _read(val, root, val_budget)
    return TextData(train_bytes, val_bytes, root, train_files, val_files)


class Batches:
    """Random windows of `block_size + 1` tokens; batch `index` depends only on its seed.

    stream: names whose batches these are, e.g. ("train", replica) or ("val", replica);
    two samplers with the same seed and stream give identical batches. Iterating gives
    batches 0, 1, 2, ... without end, so it serves as a loader for `Trainer.fit`.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        seed: int,
        stream: tuple[str | int, ...] = (),
    ) -> None:
        if tokens.numel() < block_size + 1:
            raise ConfigError(
                f"{tokens.numel()} tokens cannot fill one window of block_size={block_size} + 1; "
                "read more text (max_bytes) or use a smaller block_size"
            )
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.stream = stream

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index`: inputs and next-token targets, (B, T) int64 each."""
        g = torch.Generator().manual_seed(_hash(repr((self.seed, *self.stream, index))) >> 1)
        starts = torch.randint(
            0, self.tokens.numel() - self.block_size, (self.batch_size,), generator=g
        )
        offsets = torch.arange(self.block_size + 1)
        rows = self.tokens[starts[:, None] + offsets].long()  # (B, T + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.get(i) for i in itertools.count())


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as a 1-d int64 tensor of tokens."""
    return torch.tensor(list(text.encode()), dtype=torch.long)


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Tokens back to text; bytes that are not valid UTF-8 show as U+FFFD."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(values).decode("utf-8", errors="replace")
