"""One Hogbatch worker process: pull the shared weights, train one range, add the update.

The runner (hogbatch_run.py) spawns one device worker and N CPU workers with this module's
`main`. Each waits for an assignment on its pipe (msgpack maps, never pickles):

    train   epoch, start, count   positions of the epoch's permutation (hogbatch_dispatch)
    stop                          leave

and for each: pull the shared weights into its own parameters (recording the version),
compute the mean loss gradient on the samples, form the SGD step g + wd * w (as
torch.optim.SGD does), optionally wait out a declared emulated cost, then add -lr * step
to the shared weights in place and answer `done` (seconds, staleness, loss). A worker
whose parent stops talking for `timeout_s` or whose pipe closes leaves on its own.

Emulated costs are kept on a schedule (`due`): back-to-back updates end one declared cost
after the previous one's end, so a worker that wakes late from its wait (18 processes on
2 cores: about 3 ms an update in the bench, 16-19% of the declared speed) makes it up on
the next update instead of adding it to every one; at most one update's cost is made up,
and a worker that had to wait for its next range starts a new schedule.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import msgpack
import torch

from myelin.replicas.hogbatch_dispatch import Dispatcher
from myelin.replicas.hogbatch_model import rebuild
from myelin.replicas.hogbatch_store import SharedModel, flat_grads

__all__ = ["due_time", "main", "pack", "unpack"]


def pack(msg: dict[str, Any]) -> bytes:
    """A control message's bytes (msgpack)."""
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    """A control message from bytes; anything but a map is an error."""
    msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError(f"bad hogbatch control message: {msg!r:.200}")
    return msg


def due_time(due: float | None, start: float, cost: float) -> float:
    """When an emulated update that began at `start` and declares `cost` seconds ends:
    `cost` after the previous one was due (`due`; None: there was none, or the worker
    waited for work since), so lateness is made up, but never more than `cost` of it."""
    if due is None:
        return start + cost
    return max(due, start - cost) + cost


def main(conn: Any, index: int, job: dict[str, Any], shared: tuple, data: tuple) -> None:
    """The worker's life: set up, then serve assignments until stop, EOF or silence."""
    try:
        worker = _Worker(index, job, shared, data)
        conn.send_bytes(pack({"op": "ready", "pid": os.getpid()}))
        while True:
            if not conn.poll(0):
                worker.due = None  # it waits for work: its next update starts a new schedule
                if not conn.poll(job["timeout_s"]):
                    return  # the runner went silent: it is gone or stuck; never wait forever
            msg = unpack(conn.recv_bytes())
            if msg["op"] == "stop":
                worker.save_record()
                conn.send_bytes(pack({"op": "stopped"}))
                return
            conn.send_bytes(pack(worker.train(msg["epoch"], msg["start"], msg["count"])))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return
    except BaseException:
        try:
            conn.send_bytes(pack({"op": "error", "detail": traceback.format_exc()[-4000:]}))
        except Exception:  # noqa: S110 (the pipe is gone: the runner sees the exit)
            pass


class _Worker:
    """The worker's model, data and shared state, and one training range at a time."""

    def __init__(self, index: int, job: dict[str, Any], shared: tuple, data: tuple) -> None:
        torch.set_num_threads(job["threads"])
        torch.manual_seed(job["seed"] * 7919 + index)
        self.index, self.job = index, job
        self.device = torch.device(job["device"] if index == 0 else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.store = SharedModel(*shared, me=index, timeout_s=job["timeout_s"])
        # a private copy (rebuild's): spawning hands every process the *same* shared-memory
        # storage for the pickled model's tensors, so without it all workers (and the
        # runner's evaluator) would compute on one parameter buffer
        self.model = rebuild(job["model"]).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.x, self.y = data
        self.loss_fn = job["loss_fn"]
        self.step = torch.empty_like(self.store.weights)  # host fp32, private
        self.pulled = torch.empty_like(self.store.weights)
        self.perms = Dispatcher(self.x.shape[0], 1, job["data_seed"])
        self.perm_cache: dict[int, torch.Tensor] = {}
        self.cost = job["emulate"][0 if index == 0 else 1]  # (per update s, per sample s)
        self.record: list[dict[str, Any]] = []
        self.due: float | None = None  # when the last emulated update was due to end

    def train(self, epoch: int, start: int, count: int) -> dict[str, Any]:
        """Train on one range and add the update; the `done` message."""
        t0 = time.perf_counter()
        if epoch not in self.perm_cache:
            self.perm_cache = {epoch: self.perms.permutation(epoch)}
        idx = self.perm_cache[epoch][start : start + count]
        x = self.x[idx].to(self.device, non_blocking=True)
        y = self.y[idx].to(self.device, non_blocking=True)
        v_read = self.store.pull(self.params)
        for p in self.params:
            p.grad = None
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        flat_grads(self.params, self.step)  # device -> host copy on a GPU (synchronises)
        if self.job["weight_decay"]:
            self.decay()
        if self.cost is not None:  # emulated speed: the update ends on its schedule
            self.due = due_time(self.due, t0, self.cost[0] + self.cost[1] * count)
            left = self.due - time.perf_counter()
            if left > 0:
                time.sleep(left)
        lr = self.job["lr"] * (1.0 if self.index == 0 else self.job["cpu_lr_scale"])
        v_add, lr = self.store.add(self.step, lr, self.index, v_read, self.job["max_staleness"])
        if self.job["record"]:
            step = self.step.clone()
            rng = (epoch, start, count)
            self.record.append({"version": v_add, "read": v_read, "lr": lr, "range": rng,
                                "step": step, "at": time.monotonic()})  # fmt: skip
        tau = v_add - v_read
        return {"op": "done", "seconds": time.perf_counter() - t0, "tau": tau,
                "loss": float(loss.detach())}  # fmt: skip

    def decay(self) -> None:
        """Add weight decay to the step: weight_decay times the weights it was computed on,
        only where a parameter got a gradient (as torch.optim.SGD, which skips the others)."""
        wd, offset = self.job["weight_decay"], 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                pulled = self.pulled[offset : offset + n]
                pulled.copy_(p.detach().reshape(-1))
                self.step[offset : offset + n].add_(pulled, alpha=wd)
            offset += n

    def save_record(self) -> None:
        """Write every update this worker made (for replay and tests), if asked."""
        if self.job["record"]:
            torch.save(self.record, os.path.join(self.job["record"], f"worker{self.index}.pt"))
