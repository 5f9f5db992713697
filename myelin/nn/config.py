"""`LSHConfig`: the settings of an LSH-sampled softmax layer, each checked when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from myelin.errors import ConfigError
from myelin.nn.hashing import FAMILIES

__all__ = ["INFERENCE", "LSHConfig"]

INFERENCE = ("exact", "lsh")


@dataclass(frozen=True, kw_only=True, slots=True)
class LSHConfig:
    """How `LSHSoftmax` picks its active classes; every field is checked when built.

    family: "simhash" (signed random projections) or "dwta" (densified winner-take-all).
    bits: K, hashes per table (simhash: 1..30; dwta: codes of log2(bin_size) bits each, at
        most 30 bits a table).
    tables: L, hash tables; a class is a candidate when any table puts it in a query's bucket.
    bin_size: dwta only, coordinates each winner-take-all hash compares (2..in_features).
    bucket_cap: most classes taken from one bucket (a random subset of a fuller one).
    min_active: the random floor: the active set is padded with random classes to this size.
    min_hits: a class counts as retrieved for a row only when at least this many of the
        row's L buckets hold it (SLIDE's threshold mode): fewer, closer candidates.
    max_active: keep at most this many retrieved classes per batch (the most often
        retrieved), besides the batch's labels; None keeps all.
    rebuild_threshold: rehash every class once this share of (class, table) codes of a
        random probe of the classes active since the last build (the only rows that can
        have moved) has changed since that build.
    check_every: training steps between those probes (a probe costs probe_rows hashes). A
        training step here is one training-mode loss of the layer: in a myelin pipeline, one
        per microbatch, so `Trainer(microbatches=m)` counts m per trainer step.
    redraw_every: every this many training steps (as check_every counts them), draw new
        hash functions and rehash every class (SLIDE's "rebuild", every 1000 batches in its
        code); None: never (the tables are still rehashed as the weights move). New
        functions break up classes that one draw happens to keep in an overfull bucket.
    probe_rows: most classes hashed by a probe.
    inference: default for eval-mode forward: "exact" (all logits) or "lsh" (only the
        retrieved classes of each sample; the rest -inf).
    seed: hash functions, bucket order, floor and probes all follow from it.
    """

    family: str = "simhash"
    bits: int = 9
    tables: int = 16
    bin_size: int = 8
    bucket_cap: int = 128
    min_active: int = 1000
    min_hits: int = 1
    max_active: int | None = None
    rebuild_threshold: float = 0.1
    check_every: int = 20
    probe_rows: int = 2048
    redraw_every: int | None = None
    inference: str = "exact"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r} must be one of {', '.join(FAMILIES)}")
        if self.inference not in INFERENCE:
            raise ConfigError(f"inference={self.inference!r} must be one of {INFERENCE}")
        _int("bits", self.bits, 1, 30)
        _int("tables", self.tables, 1, 4096)
        _int("bin_size", self.bin_size, 2, 1 << 16)
        _int("bucket_cap", self.bucket_cap, 1, 1 << 30)
        _int("min_active", self.min_active, 0, 1 << 40)
        _int("min_hits", self.min_hits, 1, self.tables if type(self.tables) is int else 1)
        if self.max_active is not None:
            _int("max_active", self.max_active, 1, 1 << 40)
        _int("check_every", self.check_every, 1, 1 << 40)
        _int("probe_rows", self.probe_rows, 1, 1 << 40)
        if self.redraw_every is not None:
            _int("redraw_every", self.redraw_every, 1, 1 << 40)
        _int("seed", self.seed, 0, 2**63 - 1)
        if self.family == "dwta" and self.code_bits > 30:
            raise ConfigError(
                f"bits={self.bits} with bin_size={self.bin_size}: dwta codes take "
                f"{self.code_bits} bits a table, at most 30 allowed; lower bits or bin_size"
            )
        t = self.rebuild_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise ConfigError(f"rebuild_threshold={t!r} must be a number in (0, 1]")

    @property
    def code_bits(self) -> int:
        """Bits of one table's code: K for simhash, K * log2(bin_size) for dwta."""
        per_hash = 1 if self.family == "simhash" else (self.bin_size - 1).bit_length()
        return self.bits * per_hash

    def check_layer(self, in_features: Any, num_classes: Any) -> None:
        """The layer's sizes, and the settings that depend on them."""
        _int("in_features", in_features, 1, 1 << 40)
        _int("num_classes", num_classes, 2, 1 << 40)
        if self.family == "dwta" and self.bin_size > in_features:
            raise ConfigError(
                f"bin_size={self.bin_size} must be <= in_features={in_features} (dwta hashes "
                f"compare bin_size distinct coordinates)"
            )


def _int(name: str, value: Any, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} must be an int in [{low}, {high}]")
