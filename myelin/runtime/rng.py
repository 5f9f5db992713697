"""Random streams of their own: one per layer and replica, so dropout is as random as in one
process, repeats run to run, and does not depend on how the model is split.

Layer i of replica r draws from a generator seeded from (seed, i, r), where seed is the
script's `torch.initial_seed()` when the Trainer was built (what `torch.manual_seed` set).
While a stage runs layer i, that layer's state is in torch's default generator (and the
device's); the script's own state is put back after every forward, so it advances only by
the script's own draws, alike on every rank (a DataLoader that shuffles with it shuffles
alike on every stage of a replica). A one-stage model that runs its own forward draws from
its `pipeline_layers()`' streams as a split one would, or, without them, from one stream,
"model". What a stage draws before its first layer starts (a HuggingFace stage's model code
before its first block) comes from a scratch stream of the stage, "lead", so it moves no
layer's stream. Streams are saved in checkpoints by layer ("lead" is not), so they move
with their layers to any other split.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["LayerStreams", "stream_seed"]

MODEL = "model"  # the key of the one stream of a model that runs its own forward
LEAD = "lead"  # what a stage draws before its first layer starts: never checkpointed


def stream_seed(seed: int, key: int | str, replica: int, salt: str = "") -> int:
    """The seed of layer `key`'s stream in `replica`: 63 bits of SHA-256 of the three."""
    text = f"{seed}/{key}/{replica}{salt}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


class LayerStreams:
    """The streams of the layers one stage runs; `scope()` around each forward.

    layers: (global index, module) of each layer this stage runs in order (several modules
    may start one index's stream), or None when the stage runs a whole model's own forward
    (one stream). Until the first of those modules runs, a forward draws from a stream of
    the stage's own (LEAD): a HuggingFace stage runs its model's code before its first block
    (dropout on stand-in zeros), which must not move that block's stream. LEAD is kept
    through a retry's mark and rewind but not in checkpoints (nothing it draws is kept).
    """

    def __init__(
        self,
        seed: int,
        replica: int,
        layers: Sequence[tuple[int, nn.Module]] | None,
        device: torch.device,
    ) -> None:
        self.seed = seed
        self.replica = replica
        self.cuda = device if device.type == "cuda" else None
        keys = [i for i, _ in layers] if layers is not None else [MODEL]
        self.keys: list[int | str] = list(dict.fromkeys(keys))  # in order, each once
        self._first: int | str = LEAD if layers is not None else MODEL
        self._states = {k: self._fresh(k) for k in [*self.keys, self._first]}
        self._current: int | str | None = None
        self._calls: dict[int, int] = {}  # a module's calls in this forward, by id
        keys_of: dict[int, tuple[nn.Module, list[int | str]]] = {}
        for key, module in layers or ():
            keys_of.setdefault(id(module), (module, []))[1].append(key)
        self._hooks = [
            module.register_forward_pre_hook(self._pre_hook(keys))
            for module, keys in keys_of.values()
        ]

    def _fresh(self, key: int | str, salt: str = "") -> dict[str, torch.Tensor]:
        seed = stream_seed(self.seed, key, self.replica, salt)
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if self.cuda is not None:
            state["cuda"] = torch.Generator(self.cuda).manual_seed(seed).get_state()
        return state

    def _pre_hook(self, keys: list[int | str]) -> Any:
        """One hook a module: a module at several positions (a block reused) starts the
        stream of its n-th position at its n-th call in a forward."""

        def hook(module: nn.Module, args: Any) -> None:
            if self._current is not None:
                n = self._calls.get(id(module), 0)
                self._calls[id(module)] = n + 1
                self._switch(keys[min(n, len(keys) - 1)])

        return hook

    def _switch(self, key: int | str) -> None:
        """Keep the running stream's state, and make `key`'s the one torch draws from."""
        if key == self._current:
            return
        self._store(self._current)
        self._load(key)
        self._current = key

    def _store(self, key: int | str) -> None:
        state = self._states[key]
        state["cpu"] = torch.get_rng_state()
        if self.cuda is not None:
            state["cuda"] = torch.cuda.get_rng_state(self.cuda)

    def _load(self, key: int | str) -> None:
        state = self._states[key]
        torch.set_rng_state(state["cpu"])
        if self.cuda is not None:
            torch.cuda.set_rng_state(state["cuda"], self.cuda)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Run a forward on the layers' streams (LEAD until the first layer starts, each
        layer's from its start to the next's); the script's own generator state comes back
        afterwards."""
        user = {"cpu": torch.get_rng_state()}
        if self.cuda is not None:
            user["cuda"] = torch.cuda.get_rng_state(self.cuda)
        self._load(self._first)
        self._current = self._first
        self._calls.clear()
        try:
            yield
        finally:
            self._store(self._current)
            self._current = None
            torch.set_rng_state(user["cpu"])
            if self.cuda is not None:
                torch.cuda.set_rng_state(user["cuda"], self.cuda)

    def mark(self) -> dict[int | str, dict[str, torch.Tensor]]:
        """Where every stream is now (cheap: a state is replaced, never changed in place)."""
        return {k: dict(s) for k, s in self._states.items()}

    def rewind(self, mark: dict[int | str, dict[str, torch.Tensor]]) -> None:
        """Put every stream back where `mark` found it (a step that is forgotten)."""
        self._states = {k: dict(s) for k, s in mark.items()}

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Each stream's generator state, by layer index (or "model")."""
        return {
            "replica": self.replica,
            "streams": {str(k): dict(s) for k, s in self._states.items() if k != LEAD},
        }

    def load_state_dict(self, streams: dict[str, dict[str, torch.Tensor]], steps: int) -> list[str]:
        """Take the saved state of each of this stage's streams found in `streams`; the rest
        start fresh (seeded also by `steps`, so they do not repeat the first steps' draws).
        Returns the keys that started fresh."""
        fresh = []
        for key in self.keys:
            saved = streams.get(str(key))
            if saved is None:
                self._states[key] = self._fresh(key, salt=f"/resumed at step {steps}")
                fresh.append(str(key))
                continue
            state = {"cpu": saved["cpu"].clone()}
            if self.cuda is not None:
                cuda = saved.get("cuda")
                fallback = self._fresh(key, salt=f"/resumed at step {steps}")["cuda"]
                state["cuda"] = cuda.clone() if cuda is not None else fallback
            self._states[key] = state
        return fresh

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
