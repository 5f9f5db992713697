"""Locality-sensitive hash families: vectors in, one bucket code per table out.

    hasher = Hasher("simhash", dim=128, bits=9, tables=16, seed=0)
    codes = hasher(x)        # (N, dim) -> (N, tables) int64, each code < 2 ** hasher.code_bits

Two families, both vectorised over rows and tables (no Python loop over either):
- "simhash" (signed random projections): a code is the K sign bits of K random
  projections, so vectors at a small angle share codes (cosine similarity).
- "dwta" (densified winner-take-all, Chen & Shrivastava 2018): each of the K hashes looks
  at `bin_size` random coordinates and keeps the position of the largest; a hash whose
  coordinates are all zero (common for sparse or ReLU vectors) borrows the code of
  another hash of the same row ("densification"), trying up to `DENSIFY_TRIES` others.
Hash functions are buffers, so they are saved with the layer and travel with `.to()`
(to a device only: a dtype cast leaves them fp32, hashing is fp32 whatever the layer's
dtype); `redraw(g)` replaces them with the g-th draw of the seed, itself a buffer, so a
checkpoint's later redraws are those of the seed it was trained with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from myelin.errors import ConfigError

__all__ = ["DENSIFY_TRIES", "FAMILIES", "Hasher", "stream_seed"]

FAMILIES = ("simhash", "dwta")
DENSIFY_TRIES = 8
_CHUNK_ROWS = 8192  # rows hashed at once: bounds the (rows, K*L, bin) gather of DWTA


def stream_seed(seed: int, purpose: str) -> int:
    """The seed of the generator that draws `purpose` ("hash", "weight", ...) for `seed`.

    Not `seed` itself: `torch.Generator().manual_seed(s)` replays the numbers of
    `torch.manual_seed(s)`, so with the same s for the model and the layer the SimHash
    projections equalled the first embedding rows drawn after torch.manual_seed(s), and
    the layer's initial weights were correlated with them (-0.35)."""
    digest = hashlib.blake2b(f"myelin.nn/{purpose}/{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Hasher(nn.Module):
    """`tables` hash tables of `bits` hashes each (K and L of the SLIDE paper)."""

    def __init__(
        self, family: str, dim: int, bits: int, tables: int, bin_size: int = 8, seed: int = 0
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ConfigError(f"family={family!r} must be one of {', '.join(FAMILIES)}")
        self.family, self.dim, self.bits, self.tables = family, dim, bits, tables
        self.bin_size = bin_size
        per_hash = 1 if family == "simhash" else (bin_size - 1).bit_length()
        self.code_bits = bits * per_hash  # a table's code is < 2 ** code_bits
        self.first_seed, self.per_hash = seed, per_hash  # what `reset` draws again
        # a buffer, so a checkpoint carries the seed its redraws (`redraw`) come from
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.long))
        device = self.seed.device  # "meta" under myelin.init_empty(): shapes, drawn by `reset`
        for name, value in self._draw(0, seed).items():
            self.register_buffer(name, value.to(device))
        self.register_buffer("place", torch.arange(bits) * per_hash)  # bit offset of hash k

    def _draw(self, generation: int, seed: int) -> dict[str, torch.Tensor]:
        """The hash functions of `generation` (0: the first; SLIDE draws new ones now and
        then): projections (simhash) or coordinates (dwta), and densification's shifts.
        Drawn on the CPU whatever the default device, so every device gets the same."""
        purpose = "hash" if generation == 0 else f"hash/{generation}"
        g = torch.Generator().manual_seed(stream_seed(seed, purpose))
        n, dim, cpu = self.bits * self.tables, self.dim, torch.device("cpu")
        if self.family == "simhash":
            projection = torch.randn(dim, n, generator=g, device=cpu)
            coords = torch.zeros(0, dtype=torch.long, device=cpu)
        else:
            projection = torch.zeros(0, device=cpu)
            # (K*L, bin): the coordinates each hash sees
            coords = torch.stack(
                [torch.randperm(dim, generator=g, device=cpu)[: self.bin_size] for _ in range(n)]
            )
        # densification: hash j borrows from hash (j + shift[t]) % (K*L) on try t
        shift = torch.randint(1, max(n, 2), (DENSIFY_TRIES,), generator=g, device=cpu)
        return {"projection": projection, "coords": coords, "shift": shift}

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kw: Any) -> None:
        # checkpoints from before the seed was saved: redraws keep this hasher's own seed
        state_dict.setdefault(prefix + "seed", self.seed.clone())
        super()._load_from_state_dict(state_dict, prefix, *args, **kw)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Hasher:
        """As nn.Module's, but the projections stay fp32 under a dtype cast (`.to(bf16)`,
        `.double()`): rounded, they would give the same vectors other codes than those
        the tables hold. A device move applies to them as to every buffer."""
        projection = self.projection
        super()._apply(fn, recurse)
        if self.projection.dtype != projection.dtype:
            self.projection = projection.to(self.projection.device)
        return self

    @torch.no_grad()
    def redraw(self, generation: int) -> None:
        """Replace the hash functions by those of `generation`, in place (device kept)."""
        for name, value in self._draw(generation, int(self.seed)).items():
            getattr(self, name).copy_(value)

    @torch.no_grad()
    def reset(self) -> None:
        """The seed and first hash functions it was built with, again: for a hasher built
        on the meta device and then allocated (`to_empty`), whose buffers hold garbage."""
        self.seed.fill_(self.first_seed)
        self.place.copy_(torch.arange(self.bits) * self.per_hash)
        self.redraw(0)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, tables) int64 codes."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"Hasher expects (N, {self.dim}) vectors, got {tuple(x.shape)}")
        parts = [self._codes(x[i : i + _CHUNK_ROWS]) for i in range(0, x.shape[0], _CHUNK_ROWS)]
        if not parts:
            return torch.zeros(0, self.tables, dtype=torch.long, device=x.device)
        return torch.cat(parts)

    def _codes(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.family == "simhash":
            # fp32 whatever the layer's dtype: the sign bits are the same for every copy
            per = (x @ self.projection > 0).long()  # (N, K*L) sign bits
        else:
            seen = x[:, self.coords]  # (N, K*L, bin)
            per = seen.argmax(2)
            per = self._densify(per, (seen != 0).any(2))
        per = per.view(x.shape[0], self.tables, self.bits)
        return (per << self.place).sum(2)

    def _densify(self, codes: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Empty hashes (all coordinates zero) take the code of the first non-empty hash
        found at the shifts in `shift`; a row with every hash empty keeps code 0."""
        n = codes.shape[1]
        j = torch.arange(n, device=codes.device)
        out, empty = codes.clone(), ~full
        for shift in self.shift.tolist():  # a fixed handful of tries, not a loop over data
            alt = (j + shift) % n
            take = empty & full[:, alt]
            out = torch.where(take, codes[:, alt], out)
            empty = empty & ~take
        return torch.where(empty, torch.zeros_like(out), out)
