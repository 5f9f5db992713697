"""Hooks into `Trainer.fit`: the `Callback` protocol, and the progress bar built on it.

    class PrintVal(myelin.Callback):
        def on_log(self, trainer, metrics):
            if "val_loss" in metrics and trainer.rank == 0:
                print(metrics["step"], metrics["val_loss"])

    trainer.fit(loader, steps=100, callbacks=[PrintVal()])

`fit` calls every callback on every rank, in order, with the same numbers. A plain
function `f(trainer, metrics)` in `callbacks` is called as `on_log`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from myelin.errors import ConfigError

__all__ = ["Callback", "ProgressBar", "as_callback"]


class Callback:
    """The points of a `fit` a callback can act at; each default does nothing."""

    def on_fit_start(self, trainer: Any, first_step: int, last_step: int | None) -> None:
        """Training is about to run steps `first_step`..`last_step` (None: until the loader
        ends); a resumed trainer starts after its checkpoint's step."""

    def on_step_end(self, trainer: Any, step: int, loss: float) -> None:
        """Training step `step` is done (counting from 1), with mean loss `loss`."""

    def on_log(self, trainer: Any, metrics: dict[str, Any]) -> None:
        """A metrics row: every `log_every` steps, at validation, and at the last step."""

    def on_checkpoint(self, trainer: Any, path: str, step: int) -> None:
        """A checkpoint of step `step` was written under `path`."""

    def on_fit_end(self, trainer: Any, history: list[dict[str, Any]]) -> None:
        """`fit` is returning, or leaving with an error: `history` holds the rows so far."""


class _OnLog(Callback):
    """A plain function f(trainer, metrics), called for every metrics row."""

    def __init__(self, fn: Callable[[Any, dict[str, Any]], None]) -> None:
        self.fn = fn

    def on_log(self, trainer: Any, metrics: dict[str, Any]) -> None:
        self.fn(trainer, metrics)


def as_callback(callback: Callback | Callable[[Any, dict[str, Any]], None]) -> Callback:
    """A `Callback` as is; a function f(trainer, metrics) as a callback called on each row."""
    if isinstance(callback, Callback):
        return callback
    if callable(callback):
        return _OnLog(callback)
    raise ConfigError(
        f"callbacks: {callback!r} is neither a myelin.Callback nor a function(trainer, metrics)"
    )


class ProgressBar(Callback):
    """A tqdm bar on stderr (rank 0 only): steps, and from each row the mean loss since the
    last row, the latest validation loss, tokens/s and idle %."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.postfix = {"loss": "-", "val": "-", "tok/s": "-", "idle": "-"}

    def on_fit_start(self, trainer: Any, first_step: int, last_step: int | None) -> None:
        self.bar = tqdm(total=last_step, initial=first_step, file=sys.stderr, unit="step")

    def on_step_end(self, trainer: Any, step: int, loss: float) -> None:
        self.bar.update(1)

    def on_log(self, trainer: Any, metrics: dict[str, Any]) -> None:
        if "val_loss" in metrics:
            self.postfix["val"] = f"{metrics['val_loss']:.3f}"
        if "loss_avg" in metrics:  # (a validation before the first step has no loss yet)
            self.postfix["loss"] = f"{metrics['loss_avg']:.3f}"
            self.postfix["tok/s"] = f"{metrics['tokens_per_s']:,.0f}"
            self.postfix["idle"] = f"{100 * metrics['idle_frac']:.0f}%"
        self.bar.set_postfix(self.postfix, refresh=False)

    def on_fit_end(self, trainer: Any, history: list[dict[str, Any]]) -> None:
        if self.bar is not None:
            self.bar.close()
