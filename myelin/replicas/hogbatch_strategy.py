"""Hogbatch in the Trainer's strategy slot: `Trainer(model, SGD, loss, sync=myelin.Hogbatch())`.

The trainer's one process is the runner (hogbatch_run.Run, the same one `Hogbatch.fit`
uses): `trainer.fit(dataset, epochs=...)` hands its stage's weights, its optimizer's lr and
weight decay and the dataset to a run, whose workers decide every batch; when it returns,
the stage's parameters hold the shared weights, so `evaluate`, `eval_step`, `state_dict()`
and checkpoints see the model as trained. Between runs the strategy keeps the rule's state
and the next epoch, which checkpoints carry, so a trainer built with `resume=` continues
(the same permutations, the rule where it was). `Trainer.step` is refused: the workers,
not the script, take the batches.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import os
import sys
from typing import Any

import torch
from tqdm.auto import tqdm

from myelin.errors import ConfigError
from myelin.replicas import Context, Strategy
from myelin.replicas.flat import flatten
from myelin.replicas.hogbatch_dispatch import progress_done
from myelin.replicas.hogbatch_model import check_model
from myelin.replicas.hogbatch_run import Run, counters
from myelin.replicas.hogbatch_store import load_flat

log = logging.getLogger(__name__)

__all__ = [
    "HogbatchStrategy",
    "check_loss_fn",
    "check_model",
    "check_optimizer",
    "dataset_of",
    "worker_copy",
]

_WHY = {
    "steps": "it trains whole epochs, and its workers' updates are not steps of one size; "
    "give epochs=",
    "lr_schedule": "the workers use the optimizer's lr, fixed for the call; change "
    "trainer.optimizer's lr between fit calls",
    "eval_every": "it evaluates eval_loader on a copy of the weights after every epoch",
    "eval_batches": "it evaluates the whole eval_loader dataset after every epoch",
    "log_every": "it logs a row as each epoch completes, its loss on a copy of the weights",
}


class HogbatchStrategy(Strategy):
    """The running strategy of `sync=Hogbatch(...)` on the trainer's one rank."""

    def __init__(self, cfg: Any, ctx: Context) -> None:
        self.cfg = cfg
        self.params = ctx.params
        self.timeline = ctx.timeline  # with profile=: the run's figures and tracks go there
        if ctx.optimizer is not None:
            check_optimizer(ctx.optimizer, ctx.params)  # before any work: not a wrong run
        self.controller: dict[str, Any] | None = None  # the rule's state, once a run began
        self.next_epoch = 0
        self.progress: dict[str, Any] | None = None  # which samples the weights hold
        self.report: dict[str, Any] | None = None  # the last fit's (Hogbatch.fit's report)
        self.device_batch = cfg.device_batch[1]  # the batch the rule hands the device next
        # with profile=: every fit's counters together (summary.json's detail)
        self.totals = [{"updates": 0, "samples": 0, "busy_s": 0.0, "tau": []}
                       for _ in range(1 + cfg.cpu_workers)]  # fmt: skip
        self.fits, self.wall_s = 0, 0.0

    @property
    def batch_sizes(self) -> dict[str, int]:
        """Who trains on how many samples next: {"device": the rule's batch, "cpu": cpu_batch}."""
        return {"device": self.device_batch, "cpu": self.cfg.cpu_batch}

    def check_step(self) -> None:
        raise ConfigError(
            "Trainer.step under sync=Hogbatch(...): the strategy's workers choose and take "
            "the batches; call trainer.fit(dataset, epochs=...) (trainer.replicas.batch_sizes "
            "says the sizes)"
        )

    def state_dict(self) -> dict[str, Any]:
        if self.controller is None:
            return {}
        return {"controller": self.controller, "epoch": self.next_epoch,
                "progress": self.progress}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.controller, self.next_epoch = state["controller"], int(state["epoch"])
            self.progress = state.get("progress")  # absent in older checkpoints
            self.device_batch = int(self.controller["batch"])

    def stats(self) -> dict[str, Any]:
        """The last fit's counters: updates, update share, staleness (median, p99) and busy
        fraction per worker, the device/CPU update ratio, the device batch over time."""
        if self.report is None:
            return {}
        keys = ("wall_s", "workers", "ratio", "device_batch")
        return {k: copy.deepcopy(self.report[k]) for k in keys}

    def fit(self, trainer: Any, data: Any, *, hooks: list, **args: Any) -> list[dict[str, Any]]:
        """`trainer.fit(dataset, epochs=E, ...)` under Hogbatch: E more epochs of the run,
        a metrics row per epoch (its loss on a copy of the weights); see README."""
        for name, why in _WHY.items():
            if args.get(name) is not None:
                raise ConfigError(f"fit({name}={args[name]!r}) under sync=Hogbatch: {why}")
        if trainer.lr_scheduler is not None:
            why = _WHY["lr_schedule"]
            raise ConfigError(f"Trainer(lr_schedule=...) under sync=Hogbatch: {why}")
        epochs = 1 if args.get("epochs") is None else args["epochs"]
        max_seconds, path = args.get("max_seconds"), args.get("checkpoint_dir")
        every = args.get("checkpoint_every")
        if every is not None and (type(every) is not int or every < 1 or path is None):
            raise ConfigError(
                f"fit(checkpoint_every={every!r}) under sync=Hogbatch counts epochs: an int "
                f">= 1, with a checkpoint_dir"
            )
        if args.get("progress") and trainer.rank == 0:
            hooks = [*hooks, _EpochBar(epochs)]
        lr, wd = check_optimizer(trainer.optimizer, self.params)
        check_loss_fn(trainer.loop.stage.loss_fn)
        dtype = trainer.loop.stage.dtype  # floating inputs in it, as the Trainer's stage casts
        x, y = _cast(dataset_of(data, "fit"), dtype)
        check_model(trainer.module, x)
        evals = args.get("eval_loader")
        eval_data = None if evals is None else _cast(dataset_of(evals, "fit: eval_loader"), dtype)
        resume, start = None, flatten(self.params).cpu()  # the weights fit starts from
        if self.controller is not None:
            resume = {"weights": start, "controller": self.controller,
                      "epoch": self.next_epoch, "progress": self.progress}  # fmt: skip
            where = "Trainer.fit under sync=Hogbatch (going on from the last fit or checkpoint)"
            self.cfg.check_resume(resume, start.numel(), x.shape[0], where)
        live = Run(self.cfg, worker_copy(trainer.module), trainer.loop.stage.loss_fn, (x, y),
                   lr=lr, weight_decay=wd, epochs=epochs, eval_data=eval_data,
                   resume=resume)  # fmt: skip
        first, history = trainer.steps_done, []
        at_rows: list[int] = []  # the epochs logged so far
        key = "val_loss" if eval_data is not None else "loss"
        at: dict[int, tuple[int, int]] = {}  # epoch -> (step, device batch) as it completed
        saved: list[int] = []  # steps_done at each checkpoint taken during the run

        def log() -> None:  # the epochs whose evaluation is over, in order
            results = live.evaluator.finished(len(at_rows))
            at_rows.extend(r["epoch"] for r in results)
            for r in results:
                step, batch = at.get(r["epoch"], (trainer.steps_done, self.device_batch))
                history.append({"step": step, "epoch": r["epoch"], "wall_s": r["wall_s"],
                                key: r["loss"], "device_batch": batch})  # fmt: skip
                for hook in hooks:
                    hook.on_log(trainer, history[-1])

        def on_epoch(epoch: int, wall_s: float) -> bool:
            # the trainer's model, steps and progress: one instant of the run (workers go
            # on meanwhile), so callbacks, evaluate and a checkpoint here agree
            self._take(live.state(), trainer, first)
            at[epoch] = (trainer.steps_done, self.device_batch)
            log()
            if path is not None and every is not None and (epoch + 1) % every == 0:
                _save(trainer, path, hooks)
                saved.append(trainer.steps_done)
            return False

        for hook in hooks:
            hook.on_fit_start(trainer, first, None)
        if args.get("eval_first"):
            loss = live.evaluator.now(start)
            history.append({"step": first, key: loss})
            for hook in hooks:
                hook.on_log(trainer, history[-1])
        try:
            try:
                # max_seconds counts from the workers' start, and is checked at every update
                self.report = live.train(on_epoch, max_seconds)
            except BaseException:
                # what the workers did before the failure stays the trainer's, consistently
                # (weights, steps, progress): a retried fit or a save continues from there
                with contextlib.suppress(Exception):
                    self._take(live.state(), trainer, first)
                raise
            self._take(self.report["state"], trainer, first)
            log()
            if not progress_done(self.progress):  # out of time mid-epoch: where it stopped
                row = {"step": trainer.steps_done, "wall_s": self.report["wall_s"],
                       "epochs": self.report["epochs_seen"],
                       key: live.evaluator.loss(self.report["state"]["weights"]),
                       "device_batch": self.device_batch}  # fmt: skip
                history.append(row)
                for hook in hooks:
                    hook.on_log(trainer, row)
            if history:
                history[-1]["hogbatch"] = self.stats()  # the run's summary on its last row
            self._profile(live)
            if path is not None and saved[-1:] != [trainer.steps_done]:
                _save(trainer, path, hooks)
        finally:
            for hook in hooks:
                hook.on_fit_end(trainer, history)
        return history

    def _profile(self, live: Run) -> None:
        """With profile=: the device batch and each epoch's loss go to counter tracks of the
        trace, and the figures of every fit so far to summary.json (this rank's `detail`)."""
        tl = self.timeline
        if tl is None or not tl.enabled or self.report is None:
            return
        shift = live.runner.t0 - tl.origin  # the runner's clock starts when workers are ready
        batch = tl.counters.setdefault("hogbatch device batch", [])
        batch += [[shift + t, b] for t, b in self.report["device_batch"]]
        loss = tl.counters.setdefault("hogbatch epoch loss", [])
        loss += [[shift + e["wall_s"], e["loss"]] for e in self.report["evals"]]
        for total, st in zip(self.totals, live.runner.stats, strict=True):
            for key in ("updates", "samples", "busy_s", "tau"):
                total[key] += st[key]
        self.fits += 1
        self.wall_s += self.report["wall_s"]
        detail = {**counters(self.totals, self.wall_s), "fits": self.fits,
                  "device_batch": copy.deepcopy(batch)}  # fmt: skip
        if not math.isfinite(detail["ratio"]):
            detail["ratio"] = None  # no CPU updates (JSON has no infinity)
        tl.detail["hogbatch"] = detail

    def _take(self, state: dict[str, Any], trainer: Any, first: int) -> None:
        """A run's state (Run.state) becomes the trainer's: the weights, the rule, the next
        epoch, which samples are done, the steps (updates in those weights)."""
        load_flat(self.params, state["weights"])
        self.controller, self.next_epoch = state["controller"], state["epoch"]
        self.progress = state["progress"]
        self.device_batch = int(state["controller"]["batch"])
        trainer.steps_done = first + state["updates"]


class _EpochBar:
    """fit(progress=True) under Hogbatch: a tqdm bar on stderr of the epochs completed, with
    the latest epoch's loss (the workers' updates are no steps the script sees)."""

    def __init__(self, epochs: int) -> None:
        self.epochs, self.bar = epochs, None

    def on_fit_start(self, trainer: Any, first_step: int, last_step: int | None) -> None:
        self.bar = tqdm(total=self.epochs, file=sys.stderr, unit="epoch")

    def on_log(self, trainer: Any, metrics: dict[str, Any]) -> None:
        if "epoch" in metrics:  # (not eval_first's row)
            key = "val_loss" if "val_loss" in metrics else "loss"
            self.bar.set_postfix({key: f"{metrics[key]:.4g}"}, refresh=False)
            self.bar.update(1)

    def on_checkpoint(self, trainer: Any, path: str, step: int) -> None:
        pass

    def on_fit_end(self, trainer: Any, history: list[dict[str, Any]]) -> None:
        if self.bar is not None:
            self.bar.close()


def check_optimizer(optimizer: Any, params: Any = None) -> tuple[float, float]:
    """(lr, weight decay) of a plain SGD optimizer; anything else is a ConfigError saying why.
    `params`: the trainable parameters the run trains, which the optimizer must hold, all."""
    why = (
        "Hogbatch's workers add steps to one shared model without locks, so only stateless "
        "plain SGD (with weight decay) is sound: optimizer state (momentum, Adam's moments) "
        "would be updated by every worker at once"
    )
    if type(optimizer) is not torch.optim.SGD:
        raise ConfigError(f"{why}; got {type(optimizer).__name__}. Use torch.optim.SGD(lr=...)")
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"{why}; use one parameter group (got {len(optimizer.param_groups)})")
    g = optimizer.param_groups[0]
    for key, plain in (("momentum", 0), ("nesterov", False), ("maximize", False)):
        if g.get(key, plain) != plain:
            raise ConfigError(f"{why}; got SGD({key}={g[key]!r})")
    if params is not None:
        _check_holds(g["params"], list(params))
    lr = g["lr"]
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    return float(lr), float(g.get("weight_decay", 0.0))


def check_loss_fn(loss_fn: Any) -> None:
    """The workers are spawned processes, which receive the loss function by reference (its
    module and name): a lambda or a function defined inside another cannot go. A torch
    loss (or a partial of one) that sums over its batch is refused: every update is its
    batch's mean gradient, and the evaluation weighs each chunk's loss by its size."""
    fn, reduction = loss_fn, getattr(loss_fn, "reduction", "mean")
    while isinstance(fn, functools.partial):
        reduction = fn.keywords.get("reduction", reduction)
        fn = fn.func
    if reduction not in ("mean", "batchmean"):
        raise ConfigError(
            f"Hogbatch: loss_fn reduces with reduction={reduction!r}: Hogbatch needs a loss "
            "that is the mean over its batch (reduction='mean'), since the device's large "
            "batches and the CPU's small ones must take steps of one scale"
        )
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    name = getattr(fn, "__qualname__", "") if inspect.isfunction(fn) else ""
    if "<lambda>" in name or "<locals>" in name:
        raise ConfigError(
            f"Hogbatch: loss_fn {name} cannot be sent to the spawned worker processes (they "
            f"import a function by its module and name); use a module-level function, a "
            f"functools.partial of one, or an nn.Module loss such as torch.nn.MSELoss()"
        )


def _check_holds(held: list[Any], trainable: list[Any]) -> None:
    """The workers step every trainable parameter: an optimizer over fewer of them (to freeze
    the rest) would silently train those too."""
    held_ids, ids = {id(p) for p in held}, {id(p) for p in trainable}
    if held_ids == ids:
        return
    left_out = sum(i not in held_ids for i in ids)
    foreign = sum(i not in ids for i in held_ids)
    raise ConfigError(
        f"Hogbatch trains every parameter with requires_grad=True; the optimizer leaves out "
        f"{left_out} of the model's {len(ids)} trainable parameters"
        + (f" and holds {foreign} that are not the model's trainable ones" if foreign else "")
        + ". To freeze parameters, set requires_grad=False on them and give the optimizer "
        "the rest"
    )


def _save(trainer: Any, path: Any, hooks: list) -> None:
    trainer.save(path)
    for hook in hooks:
        hook.on_checkpoint(trainer, os.fspath(path), trainer.steps_done)


def dataset_of(data: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) from a pair of tensors or a TensorDataset of two; a DataLoader is
    refused, since Hogbatch, not the loader, decides the batch sizes."""
    if isinstance(data, torch.utils.data.DataLoader):
        raise ConfigError(
            f"{where}: under sync=Hogbatch pass the dataset (loader.dataset, a TensorDataset, "
            f"or (inputs, targets)), not a DataLoader: the strategy decides the batch sizes"
        )
    if isinstance(data, torch.utils.data.TensorDataset):
        data = data.tensors
    if isinstance(data, (tuple, list)) and any(
        isinstance(t, torch.Tensor) and t.layout != torch.strided for t in data
    ):
        raise ConfigError(
            f"{where}: under sync=Hogbatch the data must be dense tensors (the workers share "
            f"them in shared memory, which sparse ones cannot be); pass t.to_dense()"
        )
    if (
        not isinstance(data, (tuple, list))
        or len(data) != 2
        or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in data)
        or data[0].shape[0] != data[1].shape[0]
        or data[0].shape[0] < 1
    ):
        raise ConfigError(
            f"{where}: under sync=Hogbatch the data must be (inputs, targets), two tensors of "
            f"equal length >= 1, or a TensorDataset of two"
        )
    return data[0], data[1]


def _cast(data: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple:
    """(inputs, targets) with floating-point inputs in `dtype` (a float64 array from numpy)."""
    x, y = data
    return (x.to(dtype) if x.is_floating_point() else x), y


def worker_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of the stage for the workers, without myelin's own hooks (random streams,
    activation paging), which belong to this process and do not travel."""
    out = copy.deepcopy(module)
    for m in out.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for k in [k for k, fn in hooks.items() if _ours(fn)]:
                del hooks[k]
    return out


def _ours(fn: Any) -> bool:
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__module__", "").startswith("myelin.")
