"""Training loops over data loaders: `Trainer.fit` and `Trainer.evaluate`.

Each rank iterates its own loader (the ranks of one replica must see the same
batches, as with DDP). The progress bar runs on rank 0; metrics and callbacks
see the same numbers on every rank.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from myelin.errors import ConfigError
from myelin.profile.timeline import Timeline

__all__ = ["fit", "evaluate", "Callback", "Trainable"]


class Trainable(Protocol):
    """What the loops need of a trainer (`myelin.Trainer` is one)."""

    timeline: Timeline

    @property
    def rank(self) -> int: ...

    def step(self, inputs: Any = None, targets: Any = None) -> float: ...

    def eval_step(self, inputs: Any = None, targets: Any = None) -> float: ...


Callback = Callable[[Trainable, dict[str, Any]], None]


def evaluate(trainer: Trainable, loader: Iterable, max_batches: int | None = None) -> float:
    """Mean loss over the loader's batches (or the first `max_batches`), no training."""
    losses = [trainer.eval_step(*_pair(b)) for b in itertools.islice(loader, max_batches)]
    if not losses:
        raise ConfigError("evaluate: the loader gave no batches")
    return sum(losses) / len(losses)


def fit(
    trainer: Trainable,
    loader: Iterable,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    eval_loader: Iterable | None = None,
    eval_every: int | None = None,
    eval_batches: int | None = None,
    log_every: int = 10,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Train for `steps` steps or `epochs` passes over `loader` (default: one epoch).

    Every `log_every` steps (and at the last) a metrics dict {step, loss, tokens_per_s,
    idle_frac[, val_loss]} is appended to the returned history and passed to each
    callback. With `eval_loader`, validation runs every `eval_every` steps and at the end.
    """
    _check_fit_args(steps, epochs, eval_every, log_every, eval_loader)
    total = steps if steps is not None else _epoch_steps(loader, epochs or 1)
    bar = _progress_bar(trainer, total, progress)
    history: list[dict[str, Any]] = []
    window = _Window(trainer)
    done = 0
    try:
        for batch in _batches(loader, steps, epochs or 1):
            inputs, targets = _pair(batch)
            loss = trainer.step(inputs, targets)
            done += 1
            window.add(loss, _tokens(targets if targets is not None else inputs))
            last = done == total
            metrics = None
            if eval_loader is not None and (last or (eval_every and done % eval_every == 0)):
                metrics = window.flush(done)
                metrics["val_loss"] = evaluate(trainer, eval_loader, eval_batches)
            elif done % log_every == 0 or last:
                metrics = window.flush(done)
            if metrics is not None:
                history.append(metrics)
                for callback in callbacks:
                    callback(trainer, metrics)
                if bar is not None:
                    bar.set_postfix(_postfix(metrics, history), refresh=False)
            if bar is not None:
                bar.update(1)
            if last:
                break
    finally:
        if bar is not None:
            bar.close()
    return history


class _Window:
    """Loss, tokens and compute time since the last logged step."""

    def __init__(self, trainer: Trainable) -> None:
        self.trainer = trainer
        self._reset()

    def _reset(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.start = time.perf_counter()
        self.busy = self.trainer.timeline.busy_s

    def add(self, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens

    def flush(self, step: int) -> dict[str, Any]:
        wall = max(time.perf_counter() - self.start, 1e-9)
        busy = self.trainer.timeline.busy_s - self.busy
        metrics = {
            "step": step,
            "loss": self.losses[-1],
            "loss_avg": sum(self.losses) / len(self.losses),
            "tokens_per_s": self.tokens / wall,
            "idle_frac": max(0.0, 1.0 - busy / wall),
        }
        self._reset()
        return metrics


def _check_fit_args(steps, epochs, eval_every, log_every, eval_loader) -> None:
    for name, value in (("steps", steps), ("epochs", epochs), ("eval_every", eval_every)):
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"fit: {name}={value!r} must be an int >= 1")
    if type(log_every) is not int or log_every < 1:
        raise ConfigError(f"fit: log_every={log_every!r} must be an int >= 1")
    if steps is not None and epochs is not None:
        raise ConfigError("fit: give steps or epochs, not both")
    if eval_every is not None and eval_loader is None:
        raise ConfigError("fit: eval_every needs an eval_loader")


def _batches(loader: Iterable, steps: int | None, epochs: int):
    if steps is None:
        for _ in range(epochs):
            yield from loader
        return
    given = 0
    while given < steps:
        before = given
        for batch in loader:
            yield batch
            given += 1
            if given == steps:
                return
        if given == before:
            raise ConfigError("fit: the loader gave no batches")


def _epoch_steps(loader: Iterable, epochs: int) -> int | None:
    try:
        return len(loader) * epochs  # type: ignore[arg-type]
    except TypeError:
        return None


def _pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConfigError(
        f"a loader must yield (inputs, targets) pairs, got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _tokens(targets: Any) -> int:
    if isinstance(targets, torch.Tensor):
        return targets.numel()
    if isinstance(targets, (tuple, list)):
        return sum(_tokens(t) for t in targets)
    return 0


def _progress_bar(trainer: Trainable, total: int | None, enabled: bool):
    if not enabled or trainer.rank != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)


def _postfix(metrics: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, str]:
    val = next((h["val_loss"] for h in reversed(history) if "val_loss" in h), math.nan)
    return {
        "loss": f"{metrics['loss']:.4f}",
        "val": f"{val:.4f}",
        "tok/s": f"{metrics['tokens_per_s']:.0f}",
        "idle": f"{100 * metrics['idle_frac']:.0f}%",
    }
