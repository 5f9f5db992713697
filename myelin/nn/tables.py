"""Hash tables over a weight matrix's rows, and the batch's active set drawn from them.

    tables = LSHTables(hasher, num_rows=C, bucket_cap=128, seed=0)
    tables.build(weight)                       # hash every row into every table
    ids, sample = tables.query(hasher(h))      # the rows each query's buckets hold
    tables.changed_fraction(weight, probe)     # how far the weights moved since build

The L tables are one sorted array: every (table, code) key of every row, sorted, with the
row ids beside it (a CSR without the offsets array, so codes may be wide). A bucket is the
run of equal keys, found with two binary searches per (query, table); within a bucket
rows are in a random order drawn at build, so taking its first `bucket_cap` rows is a
random subset (SLIDE keeps at most 128 per bucket). Memory per row: 8 L bytes of codes
(kept to measure how far the weights moved) + 8 L of sorted keys + 4 L of ids.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from myelin.nn.hashing import Hasher, stream_seed

__all__ = ["LSHTables", "active_set", "ranges"]


class SeededModule(nn.Module):
    """A module drawing from its own torch.Generator, whose state a checkpoint carries in
    the `rng_state` buffer, so a resumed run draws what an uninterrupted one would."""

    def _seed(self, seed: int) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self.register_buffer("rng_state", self._gen.get_state())

    def _reseed(self, seed: int) -> None:
        """The generator of `seed` again, as `_seed` made it (the buffer kept in step)."""
        self._gen.manual_seed(seed)
        self.rng_state.copy_(self._gen.get_state())

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self.rng_state.copy_(self._gen.get_state())
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._gen.set_state(self.rng_state.cpu())


class LSHTables(SeededModule):
    """L hash tables over `num_rows` rows; buffers, so saved and moved with the layer."""

    def __init__(self, hasher: Hasher, num_rows: int, bucket_cap: int, seed: int = 0) -> None:
        super().__init__()
        self.hasher, self.num_rows, self.bucket_cap = hasher, num_rows, bucket_cap
        n = num_rows * hasher.tables
        self.register_buffer("codes", torch.zeros(num_rows, hasher.tables, dtype=torch.long))
        self.register_buffer("keys", torch.zeros(n, dtype=torch.long))
        self.register_buffer("ids", torch.zeros(n, dtype=torch.int32))
        self.register_buffer("builds", torch.zeros((), dtype=torch.long))
        self.first_seed = seed
        self._seed(stream_seed(seed, "buckets"))  # the bucket order's generator

    @torch.no_grad()
    def reset(self) -> None:
        """Unbuilt, the bucket order's generator as first seeded (a meta-built layer's)."""
        self.builds.zero_()
        self._reseed(stream_seed(self.first_seed, "buckets"))

    def _table_base(self) -> torch.Tensor:
        """(L,) the key offset of each table: table l's keys are l * 2**code_bits + code."""
        lanes = torch.arange(self.hasher.tables, device=self.codes.device)
        return lanes << self.hasher.code_bits

    @torch.no_grad()
    def build(self, weight: torch.Tensor) -> None:
        """Hash every row of `weight` (num_rows, dim) into every table."""
        codes = self.hasher(weight.detach())
        self.codes.copy_(codes)
        keys = (codes + self._table_base()).t().reshape(-1)  # table-major
        rows = torch.arange(self.num_rows, device=keys.device).repeat(self.hasher.tables)
        shuffle = torch.randperm(keys.numel(), generator=self._gen).to(keys.device)
        order = torch.sort(keys[shuffle], stable=True).indices
        self.keys.copy_(keys[shuffle][order])
        self.ids.copy_(rows[shuffle][order].to(torch.int32))
        self.builds += 1

    @torch.no_grad()
    def query(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For (N, L) query codes: (ids, sample), the rows in each query's L buckets (at
        most `bucket_cap` per bucket) and the query each came from, both flat int64."""
        n = codes.shape[0]
        keys = (codes + self._table_base()).reshape(-1)
        lo = torch.searchsorted(self.keys, keys)
        hi = torch.searchsorted(self.keys, keys, right=True)
        count = (hi - lo).clamp(max=self.bucket_cap)
        idx = ranges(lo, count)
        query = torch.arange(n, device=codes.device).repeat_interleave(self.hasher.tables)
        return self.ids[idx].long(), query.repeat_interleave(count)

    @torch.no_grad()
    def changed_fraction(self, weight: torch.Tensor, probe: torch.Tensor) -> float:
        """Share of (row, table) codes of rows `probe` that changed since the last build:
        how far the weights moved, in the hash's own terms (Mongoose's rebuild signal)."""
        now = self.hasher(weight.detach()[probe])
        return float((now != self.codes[probe]).float().mean())


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, device=starts.device) - torch.repeat_interleave(
        first - starts, lengths
    )


@torch.no_grad()
def active_set(
    num_classes: int,
    labels: torch.Tensor | None,
    retrieved: torch.Tensor,
    min_active: int,
    max_active: int | None,
    generator: torch.Generator,
    counts: dict[str, int] | None = None,
) -> torch.Tensor:
    """The batch's active classes, sorted: its labels, the retrieved ids (the most often
    retrieved `max_active` of them, labels kept, when there are more), and random classes
    up to `min_active` when the union is smaller (the floor SLIDE pads to). `counts`, when
    given, receives how many are "labels", "retrieved" (and not labels) and "floor"."""
    device = retrieved.device
    mask = torch.zeros(num_classes, dtype=torch.bool, device=device)
    if max_active is not None and retrieved.numel() > max_active:
        hits = torch.bincount(retrieved, minlength=num_classes).float()
        hits += torch.rand(num_classes, generator=generator).to(device)  # random tie-break
        if labels is not None:
            hits[labels[labels >= 0]] = 0  # counted below; keep the room for others
        top = torch.topk(hits, min(max_active, num_classes)).indices
        mask[top[hits[top] >= 1]] = True
    else:
        mask[retrieved] = True
    retrieved_only = int(mask.sum())
    if labels is not None:
        label_ids = labels[labels >= 0]
        retrieved_only -= int(mask[label_ids.unique()].sum())  # retrieved labels count once
        mask[label_ids] = True
    have = core = int(mask.sum())
    floor = min(min_active, num_classes)
    if floor == num_classes:
        mask[:] = True
        have = num_classes
    while have < floor:  # a few rounds at most: each draws what is missing, with repeats
        mask[torch.randint(num_classes, (floor - have,), generator=generator).to(device)] = True
        have = int(mask.sum())
    if counts is not None:
        counts.update(labels=core - retrieved_only, retrieved=retrieved_only, floor=have - core)
    return mask.nonzero().squeeze(1)
