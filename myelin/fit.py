"""The training loop over data loaders: `Trainer.fit`, and `Trainer.evaluate`.

    history = trainer.fit(
        train_loader, steps=2000, max_seconds=600,          # whichever runs out first
        lr_schedule=lambda opt: WarmupCosine(opt, warmup_steps=20, floor=0.1),
        eval_loader=val_loader, eval_every=50, eval_batches=8,
        checkpoint_dir="run/checkpoint", checkpoint_every=100,
        callbacks=[MyCallback()],
    )

Each rank iterates its own loader (the ranks of one replica must see the same batches,
as with DDP) and calls `fit` with the same arguments. Every decision that ends or shapes
the run is the same on every rank: the step count, the time budget (agreed by an
all-reduce, so all ranks stop on the same step), when to validate, log and checkpoint.
`myelin train` is this loop with a GPT, the stdlib's text and a run directory.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from myelin.callbacks import Callback, ProgressBar, as_callback
from myelin.errors import ConfigError
from myelin.metrics import Meter, all_reduce
from myelin.profile.timeline import Timeline
from myelin.runtime.group import World

__all__ = ["checked_scheduler", "Callback", "LRSchedule", "Trainable", "evaluate", "fit"]

_UNEVEN = ("shortest", "raise")

LRSchedule = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class Trainable(Protocol):
    """What the loop needs of a trainer (`myelin.Trainer` is one)."""

    world: World
    config: Any  # microbatches
    timeline: Timeline
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    steps_done: int
    seconds_trained: float  # fit's time so far, over every fit and the run it resumed
    seq: int  # training and evaluation steps run: the step number spans and messages carry
    resumed_extra: dict[str, Any] | None

    @property
    def rank(self) -> int: ...

    def step(self, inputs: Any = None, targets: Any = None) -> float: ...

    def eval_step(self, inputs: Any = None, targets: Any = None) -> float: ...

    def save(self, path: str | os.PathLike, extra: dict[str, Any] | None = None) -> object: ...

    def set_lr_schedule(self, lr_schedule: LRSchedule) -> Any: ...


def evaluate(trainer: Trainable, loader: Iterable, max_batches: int | None = None) -> float:
    """Mean loss over the loader's batches (or the first `max_batches`), no training."""
    _check_count("evaluate", "max_batches", max_batches)
    _check_last_batch(loader, trainer.config.microbatches, "evaluate")
    view = getattr(trainer, "model_view", contextlib.nullcontext)
    with view():  # the model under the replica strategy, taken once for every batch
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
    max_seconds: float | None = None,
    lr_schedule: LRSchedule | None = None,
    eval_loader: Iterable | None = None,
    eval_every: int | None = None,
    eval_batches: int | None = None,
    log_every: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    callbacks: Sequence[Callback | Callable[[Any, dict[str, Any]], None]] = (),
    progress: bool = True,
    uneven: str = "shortest",
    eval_first: bool = False,
) -> list[dict[str, Any]]:
    """Train for `steps` more steps or `epochs` passes over `loader` (default: one epoch),
    or until `max_seconds` pass; returns the metrics rows (see `myelin.metrics`). A resumed
    trainer trains that many beyond its `steps_done` (myelin train subtracts them itself).

    max_seconds: stop after the step during which this much time has passed on any rank;
        the ranks agree (an all-reduce of the time used each step), so all stop together.
        The schedule's time share counts the trainer's time before this fit too
        (`trainer.seconds_trained`, which checkpoints carry): a resumed run given what is
        left of its budget anneals on from where it stopped.
    lr_schedule: called with this stage's optimizer, returns a torch LR scheduler stepped
        after every step. One with a `progress` attribute is told, before each step(),
        the share of the run done: max(steps share, time share), so a run that time cuts
        short still anneals. It is the trainer's (`trainer.set_lr_schedule`), so a trainer
        built with resume= continues it from the checkpoint. Or give it to the Trainer
        (`Trainer(lr_schedule=...)`), and fit steps that one.
    eval_loader, eval_every, eval_batches: validate (mean `eval_step` loss over the first
        `eval_batches` of `eval_loader`, iterated afresh each time: a fixed validation set
        if it yields the same batches) every `eval_every` steps and at the end; with
        `eval_first` also before the first step (a row of only step and val_loss), so
        the run shows how far it got from where it started.
    log_every: a metrics row every this many steps (default 10), at every validation and
        at the end; each goes to the history and to every callback's on_log.
    checkpoint_dir, checkpoint_every: `trainer.save` every this many steps and at the end
        (the scheduler's state is in every checkpoint).
    callbacks: `myelin.Callback`s, or functions f(trainer, metrics) called on each row.
    progress: a progress bar on rank 0.
    uneven: when the ranks' loaders differ in length (data-parallel replicas reading
        different shards; what DDP's Join and Accelerate's even_batches are for):
        "shortest" stops every rank after the shortest loader's batches, "raise" raises
        ConfigError before the first step, naming each rank's length. Loaders without
        len() cannot be compared up front: a rank whose peer ran out raises PeerLeftError.
    Steps are numbered as the trainer counts them (`steps_done`), so a resumed trainer
    continues its numbering, and `*_every` are multiples of that number.
    Under sync=Hogbatch(...) the strategy runs the loop (replicas/hogbatch_strategy.py):
    `loader` is the dataset, whose batches its workers choose, a row per epoch (so
    `log_every` is refused), `progress` a bar of epochs, and `checkpoint_every` counts epochs.
    """
    _check_fit_args(steps, epochs, max_seconds, eval_every, log_every, eval_loader)
    if (epochs or 1) > 1 and isinstance(loader, Iterator):  # (caught later if it hides it)
        raise ConfigError(f"fit: epochs={epochs} over a one-shot iterator; {_ONE_SHOT}")
    _check_count("fit", "eval_batches", eval_batches)
    if callable(callbacks) or isinstance(callbacks, str) or not isinstance(callbacks, Iterable):
        raise ConfigError(f"fit: callbacks={callbacks!r} must be a list of callbacks")
    _check_checkpoint_args(checkpoint_dir, checkpoint_every, lr_schedule)
    if uneven not in _UNEVEN:
        raise ConfigError(f"fit: uneven={uneven!r} must be one of {', '.join(_UNEVEN)}")
    own = getattr(getattr(trainer, "replicas", None), "fit", None)
    if own is not None:  # a strategy whose workers take the batches (Hogbatch) runs the loop
        trainer._check_usable()
        trainer._freeze()  # its loop is the trainer's long run; no step() counts to AFTER_STEPS
        return own(trainer, loader, hooks=[as_callback(c) for c in callbacks], steps=steps,
                   epochs=epochs, max_seconds=max_seconds, lr_schedule=lr_schedule,
                   eval_loader=eval_loader, eval_every=eval_every, eval_batches=eval_batches,
                   checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                   eval_first=eval_first, log_every=log_every, progress=progress)  # fmt: skip
    log_every = 10 if log_every is None else log_every
    if eval_first and eval_loader is None:  # (Hogbatch's rows are the training loss)
        raise ConfigError("fit: eval_first=True needs an eval_loader")
    _check_last_batch(loader, trainer.config.microbatches, "fit")
    if eval_loader is not None:
        _check_last_batch(eval_loader, trainer.config.microbatches, "fit: eval_loader")
    hooks = [as_callback(c) for c in callbacks]
    if progress and trainer.rank == 0:
        hooks.append(ProgressBar())
    first = trainer.steps_done
    total = steps if steps is not None else _even_steps(trainer, loader, epochs or 1, uneven)
    if total == 0:  # (every rank agrees: the shortest loader is empty)
        raise ConfigError("fit: the loader gave no batches (an empty loader: nothing to train on)")
    final = first + total if total is not None else None
    scheduler = _scheduler(trainer, lr_schedule)
    plan = getattr(getattr(trainer, "replicas", None), "plan", None)
    if plan is not None and steps is None:  # DASO's epochs: the loaders' agreed length
        per_epoch = total // (epochs or 1) if total is not None else None
        plan(per_epoch, epochs or 1 if per_epoch is not None else None)
    waits = trainer.world.waits
    local = bool(getattr(getattr(trainer, "replicas", None), "local_loss", False))
    replicas, replica = trainer.world.layout.data_parallel, trainer.world.replica
    meter = Meter(trainer.timeline, replicas, waits, local_loss=local, replica=replica)
    history: list[dict[str, Any]] = []
    for hook in hooks:
        hook.on_fit_start(trainer, first, final)
    start, before = time.monotonic(), trainer.seconds_trained
    if hasattr(scheduler, "resume_at") and first:  # resumed, or a second fit: the rate
        timed = before / (before + max_seconds) if max_seconds else 0.0  # of where it is
        scheduler.resume_at(max(first / final if final else 0.0, timed))
    try:
        if eval_first and eval_loader is not None:
            history.append(
                {"step": first, "val_loss": evaluate(trainer, eval_loader, eval_batches)}
            )
            for hook in hooks:
                hook.on_log(trainer, history[-1])
        batches = _with_end(_batches(loader, steps, epochs or 1))
        for done, (batch, end) in enumerate(batches, start=1):
            inputs, targets = _pair(batch)
            t0 = time.perf_counter()
            loss = trainer.step(inputs, targets)
            tokens = _tokens(targets if targets is not None else inputs)
            meter.add(loss, tokens, time.perf_counter() - t0)
            step, lr = trainer.steps_done, _lr(trainer)
            used = _time_used(trainer, start, max_seconds, waits)
            spent = used * max_seconds if max_seconds else time.monotonic() - start
            trainer.seconds_trained = before + spent
            if scheduler is not None:  # the run's time share: this fit's and the time before
                timed = (before + spent) / (before + max_seconds) if max_seconds else 0.0
                _advance(scheduler, max(step / final if final else 0.0, timed))
            last = done == total or used >= 1.0 or end  # end: a loader without len() ran out
            val = None
            if eval_loader is not None and (last or (eval_every and step % eval_every == 0)):
                val = evaluate(trainer, eval_loader, eval_batches)
            if last or val is not None or step % log_every == 0:
                history.append(meter.row(step, lr, val))
                for hook in hooks:
                    hook.on_log(trainer, history[-1])
            for hook in hooks:
                hook.on_step_end(trainer, step, loss)
            if checkpoint_dir is not None and (
                last or (checkpoint_every and step % checkpoint_every == 0)
            ):
                _checkpoint(trainer, checkpoint_dir, hooks)
            if last:
                break
    finally:
        for hook in hooks:
            hook.on_fit_end(trainer, history)
    return history


def _scheduler(trainer: Trainable, lr_schedule: LRSchedule | None) -> Any:
    """The LR scheduler over this stage's optimizer: `lr_schedule`'s, which the trainer
    builds (continuing the checkpoint it resumed from), else the trainer's own
    (Trainer(lr_schedule=...)). None: no schedule, or nothing to train on this stage."""
    if lr_schedule is None:
        return trainer.lr_scheduler
    return trainer.set_lr_schedule(lr_schedule)


def _advance(scheduler: Any, progress: float) -> None:
    """Step the scheduler, telling it the share of the run done if it asks (`progress`)."""
    if hasattr(scheduler, "progress"):
        scheduler.progress = progress
    scheduler.step()


def _lr(trainer: Trainable) -> float | None:
    """The learning rate the step just taken used (the first group's)."""
    return trainer.optimizer.param_groups[0]["lr"] if trainer.optimizer is not None else None


def _time_used(
    trainer: Trainable, start: float, max_seconds: float | None, waits: Any = None
) -> float:
    """The share of the time budget used, the largest over all ranks (0 without one).

    The all-reduce waits for the rank that ends the step last (stage 0, whose last backward
    comes last): a step-end synchronisation, recorded as such, not host overhead."""
    if max_seconds is None:
        return 0.0
    timeline, began = trainer.timeline, trainer.timeline.now()
    used = all_reduce([(time.monotonic() - start) / max_seconds], op="max", waits=waits)[0]
    name = f"{trainer.world.stage}SYNC_FIT"
    timeline.add("allreduce", name, began, timeline.now(), trainer.seq - 1, cause="sync")
    return used


def _checkpoint(trainer: Trainable, path: Any, hooks: list[Callback]) -> None:
    trainer.save(path)  # the scheduler's state goes with its stage's shard
    for hook in hooks:
        hook.on_checkpoint(trainer, os.fspath(path), trainer.steps_done)


def _check_count(where: str, name: str, value: Any) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ConfigError(f"{where}: {name}={value!r} must be an int >= 1")


def _check_fit_args(steps, epochs, max_seconds, eval_every, log_every, eval_loader) -> None:
    counts = (
        ("steps", steps),
        ("epochs", epochs),
        ("eval_every", eval_every),
        ("log_every", log_every),
    )
    for name, value in counts:
        _check_count("fit", name, value)
    if steps is not None and epochs is not None:
        raise ConfigError("fit: give steps or epochs, not both")
    if eval_every is not None and eval_loader is None:
        raise ConfigError("fit: eval_every needs an eval_loader")
    if max_seconds is not None and (
        isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float))
    ):
        raise ConfigError(f"fit: max_seconds={max_seconds!r} must be a number of seconds")
    if max_seconds is not None and not max_seconds > 0:
        raise ConfigError(f"fit: max_seconds={max_seconds!r} must be > 0")


def _check_checkpoint_args(checkpoint_dir, checkpoint_every, lr_schedule) -> None:
    if checkpoint_dir is not None and (
        not isinstance(checkpoint_dir, (str, os.PathLike)) or not checkpoint_dir
    ):
        raise ConfigError(f"fit: checkpoint_dir={checkpoint_dir!r} must be a directory path")
    if checkpoint_every is not None:
        if type(checkpoint_every) is not int or checkpoint_every < 1:
            raise ConfigError(f"fit: checkpoint_every={checkpoint_every!r} must be an int >= 1")
        if checkpoint_dir is None:
            raise ConfigError("fit: checkpoint_every needs a checkpoint_dir")
    if lr_schedule is not None and not callable(lr_schedule):
        raise ConfigError(
            f"fit: lr_schedule={lr_schedule!r} must be a function of the optimizer that "
            f"returns an LR scheduler"
        )


def _check_last_batch(loader: Any, microbatches: int, where: str) -> None:
    """A DataLoader whose last batch has fewer rows than there are microbatches fails
    before the first step, not in the middle of the run. (A short last batch with rows
    enough splits unevenly, each microbatch counting by its rows.)"""
    size, sampler = getattr(loader, "batch_size", None), getattr(loader, "sampler", None)
    if not isinstance(size, int) or getattr(loader, "drop_last", True) or sampler is None:
        return
    try:
        last = len(sampler) % size
    except TypeError:  # a sampler of unknown length
        return
    if 0 < last < microbatches:
        raise ConfigError(
            f"{where}: the loader's last batch has {last} rows ({len(sampler)} samples in "
            f"batches of {size}), fewer than microbatches={microbatches}; pass "
            f"DataLoader(..., drop_last=True), or a batch size that leaves at least "
            f"{microbatches} rows for the last batch"
        )


_ONE_SHOT = (
    "a one-shot iterator (a generator) cannot be passed over again: give a loader that can "
    "(a list, a DataLoader) or epochs=1"
)


def _batches(loader: Iterable, steps: int | None, epochs: int) -> Iterator[Any]:
    if steps is None:
        for epoch in range(epochs):
            given = 0
            for batch in loader:
                yield batch
                given += 1
            if not given and epoch:
                raise ConfigError(
                    f"fit: the loader gave no batches on its pass {epoch + 1} of "
                    f"epochs={epochs}; {_ONE_SHOT}"
                )
        return
    given = 0
    while given < steps:
        before = given
        for batch in loader:
            yield batch
            given += 1
            if given == steps:
                return
        if given == before and given:
            raise ConfigError(
                f"fit: the loader ran out after {given} of steps={steps} batches and gave none "
                f"when passed over again: a one-shot iterator (a generator) cannot be; give a "
                f"loader that can (a list, a DataLoader) or fewer steps"
            )
        if given == before:
            raise ConfigError("fit: the loader gave no batches")


def _with_end(batches: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Each batch with whether it is the last (one batch read ahead), so the run's final
    validation, log row and checkpoint come at the end of a loader without len() too."""
    it = iter(batches)
    try:
        batch = next(it)
    except StopIteration:
        return
    for upcoming in it:
        yield batch, False
        batch = upcoming
    yield batch, True


def _even_steps(trainer: Trainable, loader: Iterable, epochs: int, uneven: str) -> int | None:
    """The steps of `epochs` passes over the loader, the same on every rank: the ranks
    compare their loaders' lengths (an all-reduce) and take the shortest, or raise."""
    mine = _epoch_steps(loader, epochs)
    size = trainer.world.layout.world_size
    if size == 1:
        return mine
    slots = [0.0] * size
    slots[trainer.rank] = -1.0 if mine is None else float(mine)
    every = [int(v) for v in all_reduce(slots, waits=trainer.world.waits)]
    if min(every) < 0 or len(set(every)) == 1:
        return mine  # one rank cannot tell (no len()): a departure names it, if it comes
    if uneven == "raise":
        lengths = ", ".join(f"rank {r}: {n} batches" for r, n in enumerate(every))
        raise ConfigError(
            f"fit: the ranks' loaders differ in length ({lengths} over {epochs} epoch(s)); "
            f"every rank must run the same steps: give them data of one length, or pass "
            f'uneven="shortest" to stop every rank at the shortest'
        )
    return min(every)


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


def checked_scheduler(scheduler: Any, lr_schedule: Any) -> Any:
    """What `lr_schedule(optimizer)` returned, if fit can step it each step with no
    arguments and checkpoint it; else a ConfigError naming lr_schedule."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(
            f"lr_schedule={lr_schedule!r} returned ReduceLROnPlateau, which steps on a metric; "
            f"fit steps the scheduler after every step without one: step it yourself from a "
            f"callback's on_log, where rows with val_loss come"
        )
    for attr in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(scheduler, attr, None)):
            raise ConfigError(
                f"lr_schedule={lr_schedule!r} returned {scheduler!r}, not an LR scheduler (it "
                f"has no {attr}()); pass a function of the optimizer that returns one"
            )
    return scheduler
