"""CPU+GPU Hogbatch and Adaptive Hogbatch (Ma and Rusu, arXiv 2004.08771): the settings.

    result = myelin.Hogbatch(cpu_workers=2, cpu_batch=4, device_batch=(64, 4096)).fit(
        model, torch.optim.SGD(model.parameters(), lr=0.05), loss_fn, (x, y), epochs=5)

One device worker (large batches) and N CPU worker processes (tiny batches) train one fp32
model kept in host shared memory: each pulls the weights, computes the gradient of its own
batch and *adds* its step in place (never writes its model back over the shared one, as the
reference code does), without locks unless `lock=True`. With `adaptive`, the device batch
follows myelin's own rule (hogbatch_rule.py; the paper publishes none) so that device
updates / CPU updates approach `ratio`, never below the batch that keeps the device's
efficiency within `budget` (budget 0 = fixed Hogbatch). The strategy decides every batch
size; `fit` walks the dataset so each sample is used once per epoch. The runner is
hogbatch_run.py; in a Trainer (`sync=Hogbatch(...)`) it runs as hogbatch_strategy.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from myelin.errors import ConfigError
from myelin.replicas.hogbatch_dispatch import progress_done
from myelin.replicas.hogbatch_rule import Controller
from myelin.replicas.hogbatch_strategy import (
    HogbatchStrategy,
    check_loss_fn,
    check_model,
    check_optimizer,
    dataset_of,
)

__all__ = ["Hogbatch", "LOSS_POLICIES", "check_optimizer"]

LOSS_POLICIES = ("raise", "reassign")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hogbatch:
    """Hogbatch's settings, field by field:

    cpu_workers: CPU worker processes (0: the device alone); cpu_threads: torch threads each;
    cpu_batch: samples per CPU update; device: the device worker's torch device ("cpu"
    emulates one); device_batch: (lo, hi) samples per device update (fixed mode uses hi);
    adaptive: move the device batch by the rule; budget: utilization the device may give up,
    in [0, 1] (0: fixed); ratio: target device updates / CPU updates (> 0); max_staleness:
    a step made on weights more than this many updates old is scaled by bound / staleness
    (None: never); cpu_lr_scale: the CPU workers' lr is the optimizer's times this (1: the
    same step size per update for every worker, as the reference code; a tiny CPU batch's
    noisy step may want less, e.g. sqrt(cpu_batch / device batch)); lock: serialise pulls
    and adds (replayable runs); on_worker_loss: "raise"
    (PeerLostError) or "reassign" (its range goes to the others); timeout_s: the longest any
    wait lasts (a worker's start or batch); emulate: declared (seconds per update, seconds
    per sample) of (device, CPU) workers, each update lasting that long on a schedule (one
    that ends late is made up on the next, up to its cost; hogbatch_worker.due_time) (None:
    real speed); record: a directory where each worker writes every update it made (replay).
    """

    cpu_workers: int = 2
    cpu_threads: int = 1
    cpu_batch: int = 4
    device: str = "cpu"
    device_batch: tuple[int, int] = (64, 4096)
    adaptive: bool = True
    budget: float = 0.3
    ratio: float = 1.0
    max_staleness: int | None = None
    cpu_lr_scale: float = 1.0
    lock: bool = False
    on_worker_loss: str = "raise"
    timeout_s: float = 120.0
    seed: int = 0
    emulate: tuple[tuple[float, float], tuple[float, float]] | None = None
    record: str | None = None

    name = "hogbatch"

    def __post_init__(self) -> None:
        for field in ("cpu_workers", "cpu_threads", "cpu_batch", "seed"):
            v = getattr(self, field)
            low = 0 if field in ("cpu_workers", "seed") else 1
            if type(v) is not int or v < low:
                raise ConfigError(f"Hogbatch({field}={v!r}): must be an int >= {low}")
        for field in ("adaptive", "lock"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(
                    f"Hogbatch({field}={getattr(self, field)!r}): must be True or False"
                )
        if self.record is not None and not isinstance(self.record, str | os.PathLike):
            raise ConfigError(f"Hogbatch(record={self.record!r}): must be None or a directory")
        lo_hi = self.device_batch
        if (
            not isinstance(lo_hi, tuple)
            or len(lo_hi) != 2
            or not all(type(b) is int for b in lo_hi)
            or not 1 <= lo_hi[0] <= lo_hi[1]
        ):
            raise ConfigError(
                f"Hogbatch(device_batch={lo_hi!r}): must be a tuple (lo, hi) of ints, 1 <= lo <= hi"
            )
        if not _number(self.budget) or not 0 <= self.budget <= 1:
            raise ConfigError(f"Hogbatch(budget={self.budget!r}): must be a number in [0, 1]")
        if not _number(self.ratio) or self.ratio <= 0:
            raise ConfigError(f"Hogbatch(ratio={self.ratio!r}): must be a number > 0")
        if not _number(self.cpu_lr_scale) or self.cpu_lr_scale <= 0:
            raise ConfigError(f"Hogbatch(cpu_lr_scale={self.cpu_lr_scale!r}): must be a number > 0")
        if self.max_staleness is not None and (
            type(self.max_staleness) is not int or self.max_staleness < 1
        ):
            raise ConfigError(
                f"Hogbatch(max_staleness={self.max_staleness!r}): must be None or an int >= 1"
            )
        if self.on_worker_loss not in LOSS_POLICIES:
            raise ConfigError(
                f"Hogbatch(on_worker_loss={self.on_worker_loss!r}): must be one of "
                f"{list(LOSS_POLICIES)}"
            )
        if not _number(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(f"Hogbatch(timeout_s={self.timeout_s!r}): must be a number > 0")
        if self.emulate is not None and not _costs(self.emulate):
            raise ConfigError(
                f"Hogbatch(emulate={self.emulate!r}): must be None or ((s per update, s per "
                f"sample) of the device, the same of a CPU worker), numbers >= 0"
            )
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"Hogbatch(device={self.device!r}): must be 'cpu' or 'cuda[:i]'")
        if kind == "cuda":  # said here, not by the spawned worker after the others started
            index, count = torch.device(self.device).index, torch.cuda.device_count()
            if not torch.cuda.is_available() or count == 0:
                raise ConfigError(f"Hogbatch(device={self.device!r}): no CUDA device here")
            if index is not None and index >= count:
                raise ConfigError(
                    f"Hogbatch(device={self.device!r}): this host has {count} CUDA device(s)"
                )

    def check(self, stages: int, data_parallel: int) -> None:
        """In a Trainer: one process holds the model and runs the workers (no pipeline
        stages, no data-parallel replicas: the workers are the replicas)."""
        for field, value in (("stages", stages), ("data_parallel", data_parallel)):
            if value != 1:
                raise ConfigError(
                    f"Trainer({field}={value}) with sync=Hogbatch(...): Hogbatch's workers "
                    f"share one whole model in one host's memory; use {field}=1 (its CPU "
                    f"workers are the replicas: cpu_workers=)"
                )

    def build(self, ctx: Any) -> Any:
        """The running strategy of a Trainer (hogbatch_strategy.py)."""
        return HogbatchStrategy(self, ctx)

    def fit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Any,
        data: tuple[torch.Tensor, torch.Tensor],
        *,
        epochs: int = 1,
        eval_data: tuple[torch.Tensor, torch.Tensor] | None = None,
        resume: dict[str, Any] | None = None,
        on_epoch: Any = None,
        eval_every_s: float | None = None,
        max_seconds: float | None = None,
    ) -> dict[str, Any]:
        """Train `model` on `data` (inputs, targets) for `epochs`; the run's report.

        The model ends holding the shared weights; the report has the loss on `eval_data`
        (default: `data`) after each epoch, computed on a copy off the training path, the
        update share, staleness and busy fraction per worker and the device batch over time,
        and `state` (weights and controller) that `resume=` continues from. `on_epoch(epoch,
        wall_s)` is called in the runner as each epoch completes (progress, tests, a time
        budget); if it returns True the run stops there (steps in flight still land).
        `eval_every_s`: also evaluate a copy every so many seconds, off the training path too
        (report `evals_timed`: wall seconds, epochs' worth of samples, loss), so time to a
        loss is read finer than once an epoch. `max_seconds`: stop that long after the
        workers are ready, mid-epoch if need be (checked at every update; the updates in
        flight land, and `state` resumes the unfinished epoch). Workers are spawned: a
        script calling this needs `if __name__ == "__main__":`."""
        from myelin.replicas.hogbatch_run import Run  # the runner imports these settings

        trained = [p for p in model.parameters() if p.requires_grad]
        lr, wd = check_optimizer(optimizer, trained)
        check_loss_fn(loss_fn)
        if type(epochs) is not int or epochs < 1:
            raise ConfigError(f"Hogbatch.fit(epochs={epochs!r}): must be an int >= 1")
        data = dataset_of(data, "Hogbatch.fit(data=...)")
        check_model(model, data[0])
        if resume is not None:
            self.check_resume(resume, sum(p.numel() for p in trained), data[0].shape[0])
        if eval_data is not None:
            eval_data = dataset_of(eval_data, "Hogbatch.fit(eval_data=...)")
        for name, value in (("eval_every_s", eval_every_s), ("max_seconds", max_seconds)):
            if value is not None and (not _number(value) or value <= 0):
                raise ConfigError(f"Hogbatch.fit({name}={value!r}): must be None or a number > 0")
        live = Run(self, model, loss_fn, data, lr=lr, weight_decay=wd, epochs=epochs,
                   eval_data=eval_data, resume=resume, eval_every_s=eval_every_s)  # fmt: skip
        return live.train(on_epoch, max_seconds)

    def check_resume(
        self, resume: Any, weights: int, samples: int, where: str = "Hogbatch.fit(resume=...)"
    ) -> None:
        """`fit(resume=...)` must be a report's `state` for this model, data and device_batch:
        what differs is a ConfigError saying so, before any worker starts."""
        if not isinstance(resume, dict) or not {"weights", "controller", "epoch"} <= set(resume):
            got = sorted(resume) if isinstance(resume, dict) else type(resume).__name__
            raise ConfigError(
                f"{where}: must be a run's report['state'] (a dict of weights, controller, "
                f"epoch and progress); got {got}"
            )
        w = resume["weights"]
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.shape != (weights,):
            got = f"{w.dtype} of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else w
            raise ConfigError(
                f"{where}: weights must be the model's {weights} trainable values, a float "
                f"tensor of shape ({weights},); got {str(got):.100}"
            )
        try:
            Controller(lo=1, hi=1, ratio=1.0, budget=0.0, adaptive=False).load_state_dict(
                resume["controller"]
            )
            batch = resume["controller"]["batch"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: controller is not the rule's state ({e!r})") from e
        lo, hi = self.device_batch
        if type(batch) is not int or (self.adaptive and not lo <= batch <= hi):
            raise ConfigError(
                f"{where}: controller's batch {batch!r} is outside device_batch={(lo, hi)}"
            )
        if type(resume["epoch"]) is not int or resume["epoch"] < 0:
            raise ConfigError(f"{where}: epoch={resume['epoch']!r} must be an int >= 0")
        progress = resume.get("progress")
        if progress is not None and _progress_of(progress, progress.get("samples", samples)):
            if progress.get("samples", samples) != samples and not progress_done(progress):
                raise ConfigError(
                    f"{where}: the run stopped in epoch {progress['epoch']} of a dataset of "
                    f"{progress['samples']} samples, and this one has {samples}: finish that "
                    f"epoch on the same data (the positions done are positions in it)"
                )
        elif progress is not None:
            raise ConfigError(
                f"{where}: progress {progress!r:.200} is not positions in a dataset of "
                f"{samples} samples (epoch, cursor <= {samples} and todo ranges within it)"
            )


def _progress_of(progress: Any, samples: int) -> bool:
    """Whether `progress` is Dispatcher.progress's shape for a dataset of `samples`."""
    try:
        epoch, cursor, todo = progress["epoch"], progress["cursor"], progress["todo"]
        ranges = [tuple(r) for r in todo]
    except (KeyError, TypeError):
        return False
    ints = all(type(v) is int for v in (epoch, cursor, *(v for r in ranges for v in r)))
    return (
        ints
        and epoch >= 0
        and 0 <= cursor <= samples
        and all(len(r) == 3 and r[0] >= 0 and 0 <= r[1] < r[1] + r[2] <= samples for r in ranges)
    )


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _costs(emulate: Any) -> bool:
    try:
        return len(emulate) == 2 and all(
            len(c) == 2 and all(_number(x) and x >= 0 for x in c) for c in emulate
        )
    except TypeError:
        return False
