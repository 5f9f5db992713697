"""The optimizer step, with fp32 master weights and optimizer state where the user asked.

`Updater` wraps the user's torch optimizer, built over fp32 master copies of the stage's
parameters (the parameters themselves when the model trains in fp32 on the device):

- "device": state and update on the device; under bf16/fp16, fp32 masters there too;
- "host": masters, gradients and state in the host pool; gradients stream to the host
  per bucket (during the last backward when nothing reduces them after), the update runs
  there with torch's foreach kernels, and updated weights stream back. On a CPU device in
  fp32 the parameters and their gradients are host memory already: only the state goes
  to the pool, and the update runs in place on the parameters (copies would free nothing);
- "stream": masters and state in the host pool, the update on the device: bucket by
  bucket, state is copied in (the next bucket's copy overlapping this bucket's update),
  stepped, and copied out.

Buckets are stepped one at a time by giving only their parameters a gradient, which any
torch optimizer with per-parameter state treats exactly like one whole step; another
optimizer (state in its param groups) is stepped once, or refused by "stream".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from myelin.errors import ConfigError
from myelin.offload.buckets import buckets
from myelin.offload.budget import DeviceBudget
from myelin.offload.factory import build_optimizer
from myelin.offload.gradients import Gradients
from myelin.offload.masters import MasterLink
from myelin.offload.pool import HostPool
from myelin.offload.state_homes import StateHomes
from myelin.offload.streaming import Streamer, is_paged, nbytes
from myelin.precision import LossScaler

__all__ = ["Updater"]


class Updater:
    """Steps `factory(masters)` for the trainable `params` of one stage.

    names: each parameter's name in the whole model, for factories that group by name.
    clip: a `runtime.clip.GlobalNorm` the gradients are clipped by before each update.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        factory: Callable[..., torch.optim.Optimizer],
        *,
        mode: str = "device",
        precision: str = "fp32",
        budget: DeviceBudget | None = None,
        pool: HostPool | None = None,
        bucket_bytes: int = 32 << 20,
        overflow_group: Any = None,
        initial: list[torch.Tensor] | None = None,
        names: list[str] | None = None,
        clip: Any = None,
        where: str = "this stage",
        sparse: frozenset[int] = frozenset(),
    ) -> None:
        # sparse: ids of parameters with sparse gradients (gradients.sparse_params)
        # initial: fp32 values the masters start from (default: the parameters themselves)
        if mode != "device" and pool is None:
            raise ConfigError(f"optimizer offload mode {mode!r} needs a host pool")
        self.params = params
        self.mode = mode
        self.half = precision != "fp32"
        self.scaler = LossScaler() if precision == "fp16" else None
        self.budget = budget
        self.pool = pool
        self.overflow_group = overflow_group
        self.device = params[0].device if params else torch.device("cpu")
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda and mode != "device" else None
        self.clip = clip
        self.grads = Gradients(params, self.half, sparse)  # fp32, summed in fp32 under half
        # "host" on a CPU in fp32: parameters and gradients are host memory; state goes alone
        self._in_place = mode == "host" and self.device.type == "cpu" and not self.half
        self.masters = self._make_masters(initial or [p.detach() for p in params])
        self.link = MasterLink(params, self.masters, self._stream)  # edits, strategies
        names = names if names is not None else [f"param{i}" for i in range(len(params))]
        self.optimizer = build_optimizer(factory, self.masters, names, where)
        if mode == "host" and self.device.type == "cuda":
            # The update runs on host tensors, for which torch would pick its per-tensor
            # loop; use the foreach kernels a device-side update would use. (On a CPU
            # machine the default stays, so offload matches no offload bit for bit.)
            for group in self.optimizer.param_groups:
                if group.get("foreach", False) is None:
                    group["foreach"] = True
        stepping = "in place" if self._in_place else mode  # in place: one step of all
        self._buckets = buckets(self.masters, bucket_bytes, self.optimizer, stepping, where)
        self._host_grads: list[torch.Tensor] = []
        self._copied: dict[int, Any] = {}  # bucket -> its copy's event (None on a CPU)
        self._armed = False
        self.changed = False  # this step's update has begun (the loop resets it each step)
        self._handles: list[Any] = []  # the stream hooks on the parameters (host mode)
        self._stepping: list[int] = []  # the bucket whose masters hold gradients now
        self._homes = StateHomes(pool) if pool is not None else None
        if mode == "host" and not self._in_place:
            self._host_grads = [self._pool_empty(m, "gradients") for m in self.masters]
            self._install_stream_hooks()
        if mode == "stream":
            args = (self.optimizer, params, self.masters, pool, self._stream, self._homes)
            self._streamer = Streamer(*args)
        if mode != "device":  # state some optimizers create eagerly (Adagrad's sum)
            self._adopt_state(list(range(len(self.masters))))
        self._accounted_states = -1
        self._account()

    # -- building ---------------------------------------------------------------------------

    def _make_masters(self, initial: list[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 masters from `initial`: the weights before a cast to half precision, so
        the masters do not start rounded."""
        if (self.mode == "device" or self._in_place) and not self.half:
            return list(self.params)
        masters = []
        for p, start in zip(self.params, initial, strict=True):
            if self.mode == "device":
                m = start.detach().to(p.device, torch.float32, copy=True)
            else:
                m = self._pool_empty(p, "master weights")
                m.copy_(start.detach())
            masters.append(nn.Parameter(m))
        return masters

    def _pool_empty(self, like: torch.Tensor, what: str) -> torch.Tensor:
        assert self.pool is not None
        return self.pool.empty(like.shape, torch.float32, what=f"optimizer {what}", lasting=True)

    def _install_stream_hooks(self) -> None:
        """Copy a bucket's gradients to the host as soon as the last backward finishes them."""
        owner = {id(self.params[i]): b for b, bucket in enumerate(self._buckets) for i in bucket}
        self._pending = [set(bucket) for bucket in self._buckets]
        index = {id(p): i for i, p in enumerate(self.params)}

        def hook(p: torch.Tensor) -> None:  # after Gradients' own hook: the fp32 sum is done
            if not self._armed:
                return
            b = owner[id(p)]
            self._pending[b].discard(index[id(p)])
            if not self._pending[b] and b not in self._copied:
                self._copy_grads(b)

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def close(self) -> None:
        """Take this updater's gradient hooks off the parameters (Trainer.close)."""
        self.grads.close()
        for handle in self._handles:
            handle.remove()

    def arm(self) -> None:
        """The next backward is the step's last on this stage and nothing reduces the
        gradients after it: stream them to the host as it finishes them."""
        if self.mode == "host":
            self._armed = True
            self._pending = [set(bucket) for bucket in self._buckets]

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Update the parameters from their gradients; False if fp16 overflowed and the
        step was skipped (on every rank)."""
        self._armed = False
        self.link.adopt_edits()  # a parameter the user edited since the last step
        if self.budget is not None and self.grads.sparse:  # the last backward's rows too
            self.budget.set("gradients", self.grads.held_bytes(), "the optimizer step")
        if (self.mode == "device" or self._in_place) and not self.half:
            if self.clip is not None:
                self.clip.clip([p.grad for p in self.params])
            if self._in_place:
                self._reserve_state([p.grad for p in self.params])
            self.changed = True
            self.optimizer.step()
            if self._in_place:
                self._adopt_state(list(range(len(self.masters))))
        elif not self._step_masters():
            self.zero_grad()
            return False
        self.zero_grad()
        self._account()
        self.link.noted()
        return True

    def _step_masters(self) -> bool:
        if self.mode == "host":
            for b in range(len(self._buckets)):
                if b not in self._copied:
                    self._copy_grads(b)
            if self.scaler is not None or self.clip is not None:  # they read every host
                for event in self._copied.values():  # gradient: its copy must have landed
                    if event is not None:
                        event.synchronize()
        elif self.mode == "device":
            for i, m in enumerate(self.masters):
                m.grad = self.grads.grad(i)
        if self.scaler is not None and not self._unscale():
            return False
        if self.clip is not None:
            self.clip.clip(self._step_grads())
        if self.mode == "device":
            self.changed = True
            self.optimizer.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)
            return True
        self._reserve_state(self._step_grads())
        if self.mode == "host":
            for b in range(len(self._buckets)):
                self._host_bucket(b)
        else:
            self._streamer.step(self._buckets, self._fp32_grads_for)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return True

    def _reserve_state(self, grads: list[torch.Tensor | None]) -> None:
        """Room in the pool for the state this step creates (Adam's, on the first step),
        taken before anything is updated: a full pool raises HostMemoryError having
        changed no weight, master or state, not after some buckets were stepped."""
        assert self._homes is not None
        device = self.device if self.mode == "stream" else torch.device("cpu")  # the pool's
        self._homes.reserve(self.optimizer, self.masters, grads, device)
        self.changed = True

    def _copy_grads(self, b: int) -> None:
        """Gradients of bucket `b` into their host buffers, as fp32."""
        if self._stream is None:
            for i in self._buckets[b]:
                if self._has_grad(i):
                    self._host_grads[i].copy_(self.grads.grad(i))
            self._copied[b] = None
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for i in self._buckets[b]:
                g = self.grads.grad(i)
                if g is not None:
                    self._host_grads[i].copy_(g, non_blocking=True)
                    g.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._copied[b] = event

    def _host_bucket(self, b: int) -> None:
        event = self._copied.get(b)
        if event is not None:
            event.synchronize()
        bucket = self._buckets[b]
        self._grads_for(bucket, lambda i: self._host_grads[i] if self._has_grad(i) else None)
        self.optimizer.step()
        self._adopt_state(bucket)
        if self._stream is None:
            with torch.no_grad():
                for i in bucket:
                    self.params[i].copy_(self.masters[i])
            return
        with torch.cuda.stream(self._stream), torch.no_grad():
            for i in bucket:
                self.params[i].copy_(self.masters[i], non_blocking=True)

    def _grads_for(self, bucket: list[int], grad: Callable[[int], torch.Tensor | None]) -> None:
        """Give only `bucket`'s masters gradients (the step's previous bucket loses its own;
        every other master has none between steps)."""
        for i in self._stepping:
            self.masters[i].grad = None
        for i in bucket:
            self.masters[i].grad = grad(i)
        self._stepping = bucket

    def _fp32_grads_for(self, bucket: list[int]) -> None:
        """The stream mode's gradients: the fp32 ones on the device (already unscaled)."""
        self._grads_for(bucket, self.grads.grad)

    def _has_grad(self, i: int) -> bool:
        return self.grads.grad(i) is not None

    def _step_grads(self) -> list[torch.Tensor | None]:
        """The fp32 gradients the update reads, one per parameter (None: it has none)."""
        if self.mode == "host":
            return [
                self._host_grads[i] if self._has_grad(i) else None for i in range(len(self.params))
            ]
        if self.mode == "device":
            return [m.grad for m in self.masters]
        return [self.grads.grad(i) for i in range(len(self.params))]

    def _unscale(self) -> bool:
        """Divide gradients by the loss scale; False (everywhere) if any rank overflowed."""
        assert self.scaler is not None
        grads = [g for g in self._step_grads() if g is not None]
        scale = self.scaler.scale
        finite = all(bool(torch.isfinite(_values(g)).all()) for g in grads)
        flag = torch.tensor([0.0 if finite else 1.0])
        if dist.is_initialized() and dist.get_world_size(self.overflow_group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.overflow_group)
        overflow = bool(flag.item())
        self.scaler.update(overflow)
        if overflow:
            return False
        for g in grads:  # sparse ones (an LSH layer's rows) scale on their own
            if g.is_sparse:
                g.mul_(1.0 / scale)
        dense = [g for g in grads if not g.is_sparse]
        if dense:
            torch._foreach_mul_(dense, 1.0 / scale)
        return True

    def zero_grad(self) -> None:
        self._stepping, self._armed = [], False
        if self._homes is not None:  # homes the step did not fill
            self._homes.release()
        self.grads.clear()
        if self.masters is not self.params:
            for m in self.masters:
                m.grad = None
        self._copied.clear()

    # -- where the state lives --------------------------------------------------------------

    def _adopt_state(self, indices: list[int]) -> None:
        """Move optimizer state that torch created lazily into the host pool."""
        for i in indices:
            state = self.optimizer.state.get(self.masters[i], {})
            for key, t in list(state.items()):
                if is_paged(t) and not self.pool.owns(t):
                    state[key] = self._homes.take(i, key, t)

    def host_bytes(self) -> int:
        """Bytes of masters, gradients and state this updater keeps in the host pool."""
        if self.mode == "device":
            return 0
        total = sum(nbytes(g) for g in self._host_grads)
        if not self._in_place:  # else the masters are the parameters, counted as such
            total += sum(nbytes(m) for m in self.masters)
        for state in self.optimizer.state.values():
            total += sum(nbytes(t) for t in state.values() if is_paged(t))
        return total

    def device_bytes(self) -> int:
        """Bytes of optimizer state (and masters) resident on the device between steps, or
        at most staged there during a streamed step (none of it stays after the step)."""
        if self.mode == "stream":
            return self._streamer.staging_peak
        if self.mode == "host":
            return 0
        total = 0
        if self.half:  # the masters (their fp32 gradients are "gradients", during the step)
            total += sum(nbytes(m) for m in self.masters)
        for state in self.optimizer.state.values():
            total += sum(nbytes(t) for t in state.values() if isinstance(t, torch.Tensor))
        return total

    def _account(self, fresh: bool = False) -> None:
        """Tell the budget the optimizer's device bytes. On the device they are counted again
        only when a parameter's state appears (or `fresh`: loaded), not on every step:
        a parameter's state keeps its size (a walk over every state tensor a step)."""
        if self.budget is None:
            return
        states = len(self.optimizer.state)
        if fresh or self.mode != "device" or states != self._accounted_states:
            self._accounted_states = states
            self._device_bytes = self.device_bytes()
        self.budget.set("optimizer", self._device_bytes, "the optimizer step")
        if self.mode == "stream":  # staged during the step only: counted at its peak, then freed
            self.budget.set("optimizer", 0, "the optimizer step")

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's own state_dict (tensors copied out of the pool), the fp32
        masters when they differ from the parameters, and the loss scale."""
        if self._stream is not None:
            self._stream.synchronize()
        sd = self.optimizer.state_dict()
        sd["state"] = {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
            for k, s in sd["state"].items()
        }
        masters = None
        if self.masters is not self.params and self.half:
            masters = [m.detach().clone() for m in self.masters]
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        return {"optimizer": sd, "masters": masters, "loss_scale": scaler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._stream is not None:  # copies from the masters may still be in flight
            self._stream.synchronize()
        old = [
            t
            for entry in self.optimizer.state.values()
            for t in entry.values()
            if isinstance(t, torch.Tensor) and self.pool is not None and self.pool.owns(t)
        ]
        self.optimizer.load_state_dict(state["optimizer"])  # raises before anything is freed
        if self._homes is not None:
            self._homes.forget()
        for t in old:  # the loaded state replaces what the pool held
            self.pool.free(t)
        masters = state.get("masters")
        with torch.no_grad():
            if masters is not None:
                for m, saved in zip(self.masters, masters, strict=True):
                    m.copy_(saved)
            elif self.masters is not self.params:  # fp32 masters are the parameters' values
                for p, m in zip(self.params, self.masters, strict=True):
                    m.copy_(p)
        self.link.noted()
        if self.scaler is not None and state.get("loss_scale") is not None:
            self.scaler.load_state_dict(state["loss_scale"])
        if self.mode != "device":
            self._adopt_state(list(range(len(self.masters))))
        self._account(fresh=True)

    def _synchronize(self) -> None:
        if self._stream is not None:  # copies to or from the masters may be in flight
            self._stream.synchronize()

    def master_weights(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> the fp32 weights the optimizer steps for it (the master copy;
        the parameter itself when it trains in fp32 on the device)."""
        self._synchronize()
        return {id(p): m.detach() for p, m in zip(self.params, self.masters, strict=True)}

    def sync_from_params(self) -> None:
        """Masters take the parameters' values (after the parameters were loaded)."""
        if self.masters is self.params:
            return
        self._synchronize()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                m.copy_(p)
        self.link.noted()


def _values(g: torch.Tensor) -> torch.Tensor:
    """A gradient's stored numbers: a sparse one's values, else itself."""
    return g.coalesce().values() if g.is_sparse else g
