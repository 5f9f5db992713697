"""Hogbatch's runner: start the workers, hand out ranges, watch them, report, clean up.

Order of events: the model's trainable parameters become one shared fp32 segment
(hogbatch_store); worker 0 (the device) and workers 1..N (CPU) are spawned with it and the
dataset (shared memory too; their environment loses the rendezvous variables, as the hub's
does); each says `ready`. Then, until every epoch is done: the device holds AHEAD ranges
(its batch from the adaptive rule) and each CPU worker CPU_AHEAD (`cpu_batch`), each `done`
feeds the rule and the counters, and each completed epoch's weights (and, with
`eval_every_s`, the weights every so many seconds) are copied and evaluated in a thread,
off the training path. A worker that dies is a PeerLostError or has
its range reassigned (`on_worker_loss`); a worker silent past `timeout_s` is a
DeadlineError. Whatever happens, every worker is stopped, then killed, before returning.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from collections import deque
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from myelin.errors import DeadlineError, MyelinError, PeerLostError
from myelin.replicas.hogbatch_dispatch import Dispatcher, Range, progress_done
from myelin.replicas.hogbatch_eval import Evaluator
from myelin.replicas.hogbatch_model import portable
from myelin.replicas.hogbatch_rule import Controller
from myelin.replicas.hogbatch_store import SharedModel, load_flat
from myelin.replicas.hogbatch_worker import main as worker_main
from myelin.replicas.hogbatch_worker import pack, unpack

if TYPE_CHECKING:
    from myelin.replicas.hogbatch import Hogbatch

__all__ = ["AHEAD", "CPU_AHEAD", "Run", "counters", "params_of"]

# Ranges a worker holds at once: the one it trains and the next ones, already in its pipe,
# so it never waits a round trip through the runner between updates (in real mode, tiny
# CPU batches spent more time on that wait than on their gradient), nor for a runner late
# by less than the queue's work (18 processes on 2 shared cores: the runner's answer took
# p50 1-11 ms, p99 20-45 ms in the emulated bench, against updates of 12 ms on a CPU
# worker and 16 ms on the device; with 2 ranges the device waited 12 ms an update for its
# next range under load, with 3 about 1 ms). The device's queued ranges carry the rule's
# batch when they were sent, up to two device batches behind its latest; a CPU worker's
# batch never changes, so its queue is longer.
AHEAD = 3
CPU_AHEAD = 4

_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip


class Run:
    """One run, set up and not started: its shared model (`store`), its rule (`ctl`) and
    its workers (`runner`). `train` runs it; `on_epoch` may look at all three meanwhile
    (Trainer.fit's checkpoints take the weights and the rule's state there)."""

    def __init__(
        self,
        cfg: Hogbatch,
        model: torch.nn.Module,
        loss_fn: Any,
        data: tuple[torch.Tensor, torch.Tensor],
        *,
        lr: float,
        weight_decay: float,
        epochs: int,
        eval_data: tuple[torch.Tensor, torch.Tensor] | None,
        resume: dict[str, Any] | None,
        eval_every_s: float | None = None,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ctx = mp.get_context("spawn")
        self.store = SharedModel.create(self.params, 1 + cfg.cpu_workers,
                                        self.ctx.Lock() if cfg.lock else None,
                                        timeout_s=cfg.timeout_s)  # fmt: skip
        self.ctl = Controller(lo=cfg.device_batch[0], hi=cfg.device_batch[1], ratio=cfg.ratio,
                              budget=cfg.budget, adaptive=cfg.adaptive)  # fmt: skip
        self.first_epoch, progress = 0, None
        if resume is not None:
            self.store.weights.copy_(resume["weights"])
            self.ctl.load_state_dict(resume["controller"])
            if not cfg.adaptive:
                self.ctl.batch = cfg.device_batch[1]  # fixed: hi, whatever the run before chose
            for w in [w for w in self.ctl.samples if w > cfg.cpu_workers]:
                self.ctl.forget(w)  # a worker of the run before that this one does not have
            self.first_epoch = int(resume["epoch"])
            progress = resume.get("progress")  # absent: an older checkpoint, whole epochs
            if progress is not None and progress_done(progress):
                progress = None  # its epochs are complete: the next starts fresh, any data
        if cfg.record is not None:
            os.makedirs(cfg.record, exist_ok=True)  # before any training it would lose
        self.data = tuple(t.detach().cpu().contiguous().share_memory_() for t in data)
        host_model = copy.deepcopy(model).cpu()
        self.job = {"model": portable(host_model), "loss_fn": loss_fn, "lr": lr,
                    "weight_decay": weight_decay, "device": cfg.device,
                    "threads": cfg.cpu_threads, "seed": cfg.seed, "data_seed": cfg.seed,
                    "timeout_s": cfg.timeout_s, "record": cfg.record,
                    "max_staleness": cfg.max_staleness, "cpu_lr_scale": cfg.cpu_lr_scale,
                    "emulate": cfg.emulate or (None, None)}  # fmt: skip
        disp = Dispatcher(self.data[0].shape[0], epochs, cfg.seed, self.first_epoch, progress)
        self.runner = _Run(cfg, self.ctl, self.store, disp, eval_every_s)
        eval_model = copy.deepcopy(host_model).eval()  # not the workers'; no dropout in eval
        self.evaluator = Evaluator(eval_model, loss_fn, eval_data or self.data,
                                    params_of(eval_model))  # fmt: skip

    def train(self, on_epoch: Any = None, max_seconds: float | None = None) -> dict[str, Any]:
        """Start the workers, train every epoch (or for `max_seconds` from when the workers
        are ready: the batches in flight land, the epoch stays unfinished), stop them; the
        model given holds the shared weights after; the report (with `evals`,
        `evals_timed` and `state`)."""
        try:
            self.runner.start(self.ctx, self.job, self.data)
            self.runner.drive(self.evaluator, on_epoch, max_seconds)
            self.runner.stop(self.evaluator)
            self.runner.tell(on_epoch)  # epochs the batches in flight completed
        finally:
            self.runner.kill()
            self.evaluator.close()
        report = self.runner.report()
        report["evals"] = self.evaluator.results()
        report["evals_timed"] = self.evaluator.timed_results()
        report["state"] = self.state()
        load_flat(self.params, report["state"]["weights"])
        return report

    def state(self) -> dict[str, Any]:
        """What `resume=` continues from, taken at one instant (under the lock, if any): the
        weights, the rule's state, the first epoch not complete, which samples the weights
        hold (`progress`: a resumed run trains each other one once) and `updates`, how
        many updates they hold. Safe while the workers run, and after they died."""
        weights, counters = self.runner.snapshot(counted=True)
        landed = {w: int(counters[w]) - s["updates"] for w, s in enumerate(self.runner.stats)}
        return {"weights": weights, "controller": self.ctl.state_dict(),
                "epoch": self.next_epoch(), "progress": self.runner.disp.progress(landed),
                "updates": int(counters.sum())}  # fmt: skip

    def next_epoch(self) -> int:
        """The first epoch not completed (`Dispatcher.first_unfinished`)."""
        return self.runner.disp.first_unfinished(self.first_epoch)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable parameters, in the order the shared segment holds them."""
    return [p for p in model.parameters() if p.requires_grad]


class _Run:
    """The workers of one run and what they have done."""

    def __init__(self, cfg: Hogbatch, ctl: Controller, store: SharedModel, disp: Dispatcher,
                 eval_every_s: float | None = None) -> None:  # fmt: skip
        self.cfg, self.ctl, self.store, self.disp = cfg, ctl, store, disp
        self.eval_every_s = eval_every_s
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.alive: set[int] = set()
        self.busy: dict[int, deque[Range]] = {}  # worker -> its ranges, oldest (in work) first
        n = 1 + cfg.cpu_workers
        self.stats = [{"updates": 0, "samples": 0, "busy_s": 0.0, "tau": []} for _ in range(n)]
        self.batches: list[tuple[float, int]] = []  # (wall s, device batch) when it changed
        self.t0 = time.perf_counter()
        self.wall_s = 0.0
        self.completed = 0  # epochs reported to on_epoch

    def start(self, ctx: Any, job: dict[str, Any], data: tuple) -> None:
        """Spawn the workers (environment without rendezvous variables); wait for ready."""
        saved = {k: os.environ.pop(k) for k in _RENDEZVOUS if k in os.environ}
        try:
            for w in range(1 + self.cfg.cpu_workers):
                parent, child = ctx.Pipe()
                name = "hogbatch-device" if w == 0 else f"hogbatch-cpu{w}"
                p = ctx.Process(target=worker_main, name=name, daemon=True,
                                args=(child, w, job, self.store.handles(), data))  # fmt: skip
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        finally:
            os.environ.update(saved)
        deadline = time.monotonic() + self.cfg.timeout_s
        for w, conn in enumerate(self.conns):
            left = deadline - time.monotonic()
            ready = wait([conn, self.procs[w].sentinel], timeout=max(left, 0))
            if conn not in ready:
                if ready:
                    raise PeerLostError(w, "starting", f"Hogbatch worker {w} died while starting")
                raise DeadlineError(f"Hogbatch worker {w} not ready after {self.cfg.timeout_s}s")
            try:
                self._check(w, unpack(conn.recv_bytes()), "ready")
            except EOFError:
                raise PeerLostError(
                    w, "starting", f"Hogbatch worker {w} died while starting"
                ) from None
            self.alive.add(w)
        self.t0 = time.perf_counter()

    def drive(
        self, evaluator: Evaluator, on_epoch: Any = None, max_seconds: float | None = None
    ) -> None:
        """Hand out ranges until every epoch is done or `max_seconds` have passed since the
        workers were ready; evaluate each completed epoch (and a copy every `eval_every_s`
        seconds)."""
        deadline = self.t0 + max_seconds if max_seconds is not None else None
        self.batches.append((0.0, self.ctl.batch))
        self._assign()
        heard = time.monotonic()  # when a worker last answered
        next_eval = self.eval_every_s  # wall seconds of the next copy taken on the clock
        while not self.disp.all_done():
            watch = [self.conns[w] for w in self.alive] + [
                self.procs[w].sentinel for w in self.alive
            ]
            timeout = self.cfg.timeout_s - (time.monotonic() - heard)
            if next_eval is not None:
                timeout = min(timeout, next_eval - (time.perf_counter() - self.t0))
            if deadline is not None:
                timeout = min(timeout, deadline - time.perf_counter())
            ready = wait(watch, timeout=max(timeout, 0))
            late = deadline is not None and time.perf_counter() >= deadline
            if next_eval is not None and time.perf_counter() - self.t0 >= next_eval:
                wall = time.perf_counter() - self.t0
                evaluator.submit_timed(self._seen(), wall, self.snapshot())
                next_eval = (math.floor(wall / self.eval_every_s) + 1) * self.eval_every_s
            if not ready:
                if late:
                    break  # out of time: what is in flight still lands (stop)
                if time.monotonic() - heard < self.cfg.timeout_s:
                    continue  # woken for a copy on the clock
                busy = {w: [str(r) for r in q] for w, q in self.busy.items() if q}
                raise DeadlineError(
                    f"Hogbatch: no worker answered for {self.cfg.timeout_s}s; busy: {busy}"
                )
            heard = time.monotonic()
            for w in sorted(self.alive):
                conn = self.conns[w]
                try:
                    if conn in ready or conn.poll():
                        self._done(w, unpack(conn.recv_bytes()), evaluator)
                        continue
                except (EOFError, ConnectionResetError):
                    pass  # its pipe closed: it died (the sentinel says so too)
                else:
                    if self.procs[w].sentinel not in ready:
                        continue
                self.procs[w].join(5)
                self._lost(w, evaluator)
            self._assign()
            if self.tell(on_epoch) or late:
                break  # asked to stop after this epoch, or out of time; work in flight lands
        self.wall_s = time.perf_counter() - self.t0

    def tell(self, on_epoch: Any) -> bool:
        """Call `on_epoch` for each epoch completed since the last call; whether one asked
        to stop."""
        stop = False
        while self.completed < len(self.disp.completed):
            if on_epoch is not None:
                epoch = self.disp.completed[self.completed]
                stop = on_epoch(epoch, time.perf_counter() - self.t0) is True or stop
            self.completed += 1
        return stop

    def _assign(self) -> None:
        for w in sorted(self.alive):
            queue = self.busy.setdefault(w, deque())
            while len(queue) < (AHEAD if w == 0 else CPU_AHEAD):
                batch = self.ctl.batch if w == 0 else self.cfg.cpu_batch
                r = self.disp.take(w, batch)
                if r is None:
                    break
                self.conns[w].send_bytes(pack({"op": "train", **r._asdict()}))
                queue.append(r)
        if not any(self.busy.values()) and not self.disp.all_done():
            raise PeerLostError(-1, "training", "Hogbatch: no worker is left to train")

    def _done(self, w: int, msg: dict[str, Any], evaluator: Evaluator) -> None:
        self._finish(w, self._record(w, msg), evaluator)

    def _finish(self, w: int, r: Range, evaluator: Evaluator) -> None:
        if self.disp.done(w, r):
            wall = time.perf_counter() - self.t0
            evaluator.submit(r.epoch, wall, self.snapshot(), self._seen())

    def snapshot(self, counted: bool = False) -> Any:
        """The shared weights (with `counted`: and the update counters read with them). A
        worker that died holding the lock is found meanwhile and the lock freed; past
        `timeout_s` a DeadlineError names the holder."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                return self.store.snapshot(timeout_s=0.2, counted=counted)
            except DeadlineError:
                for w in sorted(self.alive):
                    if not self.procs[w].is_alive():
                        self.store.release_from(w)
                if time.monotonic() > deadline:
                    raise

    def _record(self, w: int, msg: dict[str, Any]) -> Range:
        """Count a `done` message: the update, its samples and time, and the rule's fit."""
        self._check(w, msg, "done")
        r = self.busy[w].popleft()  # a worker trains its ranges in the order sent
        st = self.stats[w]
        st["updates"] += 1
        st["samples"] += r.count
        st["busy_s"] += msg["seconds"]
        st["tau"].append(msg["tau"])
        before = self.ctl.batch
        self.ctl.observe(w, r.count, msg["seconds"], device=w == 0)
        if self.ctl.batch != before:
            self.batches.append((time.perf_counter() - self.t0, self.ctl.batch))
        return r

    def _seen(self) -> float:
        """Epochs' worth of samples trained so far in this run."""
        return sum(s["samples"] for s in self.stats) / self.disp.samples

    def _check(self, w: int, msg: dict[str, Any], want: str) -> None:
        if msg["op"] == "error":
            raise MyelinError(f"Hogbatch worker {w} failed:\n{msg.get('detail', '')}")
        if msg["op"] != want:
            raise MyelinError(f"Hogbatch worker {w}: expected {want!r}, got {msg['op']!r}")

    def _lost(self, w: int, evaluator: Evaluator) -> None:
        code = self.procs[w].exitcode
        self.alive.discard(w)
        self.ctl.forget(w)
        self.store.release_from(w)  # died holding the lock: the others would wait for ever
        queue = self.busy.pop(w, deque())
        # Ranges whose update is in the weights though their `done` never came (it died
        # between the two): they are done, not to be trained again. Its counter says how many.
        landed = int(self.store.counters[w]) - self.stats[w]["updates"]
        for _ in range(min(landed, len(queue))):
            r = queue.popleft()
            self.stats[w]["updates"] += 1
            self.stats[w]["samples"] += r.count
            self._finish(w, r, evaluator)
        r = list(queue)
        if self.cfg.on_worker_loss == "raise":
            raise PeerLostError(
                w, f"training {r}", f"Hogbatch worker {w} died (exit code {code}) training {r}"
            )
        self.disp.lose(w)

    def stop(self, evaluator: Evaluator) -> None:
        """Ask every live worker to stop (it writes its record first) and wait for them all
        at once. The batches in flight land (an epoch they complete is evaluated); a worker
        that dies meanwhile is lost as in training (`on_worker_loss`), its ranges left to do,
        and the lock it may hold is freed at once (the others would wait on it)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        for w in sorted(self.alive):
            try:
                self.conns[w].send_bytes(pack({"op": "stop"}))
            except (BrokenPipeError, ConnectionResetError):
                pass  # it died: found below
        pending = set(self.alive)
        while pending and (left := deadline - time.monotonic()) > 0:
            ready = wait([self.conns[w] for w in pending]
                         + [self.procs[w].sentinel for w in pending], left)  # fmt: skip
            for w in sorted(pending):
                if self._drain(w, evaluator):
                    pending.discard(w)
                elif self.procs[w].sentinel in ready:
                    pending.discard(w)
                    self.procs[w].join(5)
                    self._lost(w, evaluator)  # died before saying it stopped
        self.wall_s = time.perf_counter() - self.t0  # the batches that landed took this long
        for w in sorted(self.alive):
            self.procs[w].join(max(deadline - time.monotonic(), 0))

    def _drain(self, w: int, evaluator: Evaluator) -> bool:
        """Read what worker `w` sent while stopping; whether it said it stopped."""
        conn = self.conns[w]
        try:
            while conn.poll():
                msg = unpack(conn.recv_bytes())
                if msg["op"] != "done":
                    self._check(w, msg, "stopped")
                    return True
                # a batch in flight when the run was cut short: its update is in the weights
                self._finish(w, self._record(w, msg), evaluator)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass  # its pipe closed: it died (its sentinel says so)
        return False

    def kill(self) -> None:
        """Kill whatever still runs and close the pipes (safe after stop)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()

    def report(self) -> dict[str, Any]:
        """Update share, staleness (median, p99), busy fraction per worker; the batch trace."""
        wall = self.wall_s or (time.perf_counter() - self.t0)
        return {
            **counters(self.stats, wall),
            "epochs_seen": self._seen(),
            "device_batch": self.batches,
            "settings": {
                "adaptive": self.cfg.adaptive,
                "budget": self.cfg.budget,
                "ratio": self.cfg.ratio,
                "lock": self.cfg.lock,
            },  # fmt: skip
        }


def counters(stats: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """From `stats` (per worker updates, samples, busy_s, tau list) over `wall` seconds: per
    worker updates, samples, share, staleness (median, p99), busy fraction; the ratio."""
    total = sum(s["updates"] for s in stats) or 1
    workers = []
    for w, s in enumerate(stats):
        tau = sorted(s["tau"])
        workers.append({
            "worker": "device" if w == 0 else f"cpu{w}",
            "updates": s["updates"],
            "samples": s["samples"],
            "share": s["updates"] / total,
            "tau_median": float(statistics.median(tau)) if tau else 0.0,  # (an int or half)
            "tau_p99": tau[min(len(tau) - 1, int(0.99 * len(tau)))] if tau else 0,
            "busy": s["busy_s"] / wall if wall > 0 else 0.0,
        })  # fmt: skip
    dev = stats[0]["updates"]
    cpu = total - dev if total > dev else 0
    return {"wall_s": wall, "workers": workers, "ratio": dev / cpu if cpu else float("inf")}
