"""The EASGD family (Zhang, Choromanska, LeCun 2015; You, Buluc, Demmel 2017).

Each replica keeps its own parameters x_i and, every `tau` steps (from step 0), is pulled
toward a center x~ with the moving rate alpha (= eta * rho):

    sync      one all-reduce of the x_i per round; every rank keeps the center:
                  d = x_i - x~ (before the optimizer step)
                  x_i <- step(x_i) - alpha d,   x~ <- x~ + alpha (sum_i x_i - p x~)
              lock-step and in a fixed reduction order, so bitwise reproducible. The
              all-reduce runs through the round's steps: the center takes its sum when
              it is next needed (the next round's pull, evaluation, a checkpoint), the
              same numbers as taking it at once, without waiting for it at once.
              With `downcast="fp16"` or `"bf16"` a round sends d_i = x_i - x~ in that
              dtype instead (half the bytes) and the center moves by alpha sum_i d_i:
              every rank still takes the one sum (identical centers, reproducible), and
              what is rounded is the small difference, not the weights
    async     the center lives in the hub (replicas/hub.py); an exchange is one round
              trip served first come first served: send x_i, get x~ back while the hub
              moves x~ by alpha (x_i - x~) (You et al.)
    hogwild   read x~, then push e = alpha (x_i - x~), which the hub adds without a lock
              against other workers' reads (Zhang's Alg. 1 as the author's code runs it)

Every exchange conserves x_i + x~. `momentum` (MEASGD, You et al.) is heavy-ball
momentum on the local SGD update, v <- mu v + (step(x) - x) = mu v - lr g, x <- x + v,
with the elastic term kept out of v; it needs plain torch.optim.SGD as the optimizer
(anything else is a ConfigError naming the field: an adaptive optimizer's update, or
SGD's own momentum, would take a second momentum).
What the model is: the center x~ (as the papers evaluate it); evaluation, state_dict()
and checkpoints use it (`model_view`; under the hub every replica reads it after all
replicas' exchanges landed, between two barriers over them, so all see one center).
Gradients are never averaged, and neither is the training loss at each step: between
exchanges the replicas hold different models, so `step()` returns this replica's own
loss and no step waits for the others outside its exchange; fit's metrics rows (a
collective already) report the mean over replicas, and evaluation the mean of the
center's loss over the replicas' batches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from myelin.errors import ConfigError
from myelin.replicas import Context, Strategy, own_state
from myelin.replicas.collectives import DOWNCAST, Collectives, summable
from myelin.replicas.flat import flatten, holding, moved_weights, unflatten
from myelin.runtime.tied import equalise

__all__ = ["EASGD", "EasgdReplicas", "MODES", "check_local_sgd"]

MODES = ("sync", "async", "hogwild")


@dataclass(frozen=True, kw_only=True, slots=True)
class EASGD:
    """EASGD's settings. tau: steps between exchanges; alpha: moving rate (default
    0.9 / replicas, i.e. beta = 0.9); mode: "sync", "async" or "hogwild"; momentum: MEASGD's
    mu on the local SGD update (0: plain EASGD; > 0 needs torch.optim.SGD without its own
    momentum); downcast (sync mode): the dtype a round sends, "fp32" (x_i, as the papers)
    or "fp16"/"bf16" (x_i - x~, half the bytes; probed on the backend, fp32 where it
    cannot sum it). In async and hogwild modes a hub silent for
    TransportConfig.peer_timeout_s is a PeerLostError on every rank."""

    tau: int = 1
    alpha: float | None = None
    mode: str = "sync"
    momentum: float = 0.0
    downcast: str = "fp32"

    name = "easgd"
    # each replica applies its own gradient, never averaged: max_grad_norm clips it by its
    # own norm, over its own pipeline ranks (stage_setup.py)
    own_gradients = True

    def __post_init__(self) -> None:
        if type(self.tau) is not int or self.tau < 1:
            raise ConfigError(f"EASGD(tau={self.tau!r}): must be an int >= 1")
        if self.alpha is not None and not _number(self.alpha, 0.0, 1.0):
            raise ConfigError(f"EASGD(alpha={self.alpha!r}): must be a number in [0, 1]")
        if self.mode not in MODES:
            raise ConfigError(f"EASGD(mode={self.mode!r}): must be one of {list(MODES)}")
        if not _number(self.momentum, 0.0, 1.0) or self.momentum == 1.0:
            raise ConfigError(f"EASGD(momentum={self.momentum!r}): must be a number in [0, 1)")
        if not isinstance(self.downcast, str) or self.downcast not in DOWNCAST:
            raise ConfigError(f"EASGD(downcast={self.downcast!r}): must be one of {list(DOWNCAST)}")
        if self.downcast != "fp32" and self.mode != "sync":
            raise ConfigError(
                f"EASGD(downcast={self.downcast!r}) needs mode='sync' (got {self.mode!r}): "
                f"the hub's exchanges carry x_i and x~ themselves, and rounding them would "
                f"round the weights, not a difference"
            )

    def check(self, stages: int, data_parallel: int) -> None:
        """Raise before any work if alpha makes the sync center diverge."""
        alpha = self.moving_rate(data_parallel)
        # the workers' mean minus the center shrinks by 1 - alpha - beta a round (beta =
        # alpha x replicas): stable for alpha + beta < 2 (Zhang et al.)
        if self.mode == "sync" and not 0 <= alpha * (data_parallel + 1) < 2:
            raise ConfigError(
                f"EASGD(alpha={alpha}): sync mode needs alpha + beta = alpha x (replicas + 1) "
                f"< 2 (here {alpha * (data_parallel + 1):g}), or the center diverges"
            )

    def moving_rate(self, replicas: int) -> float:
        """alpha, or 0.9 / replicas by default (beta = 0.9, Zhang et al.)."""
        return float(self.alpha) if self.alpha is not None else 0.9 / replicas

    def build(self, ctx: Context) -> Strategy:
        """The running strategy on this rank (also with one replica: the center moves)."""
        return EasgdReplicas(self, ctx)


def check_local_sgd(spec: EASGD, optimizer: Any) -> None:
    """MEASGD's momentum is the local SGD update's, v <- mu v - lr g (You et al.; Zhang's
    EAMSGD): a ConfigError unless the optimizer is plain SGD, naming the field. On an
    adaptive optimizer (Adam's moments) or SGD's own momentum it would be a second
    momentum on an update that has one: a larger, lagging step, not MEASGD."""
    name = type(optimizer).__name__
    got = None
    if not isinstance(optimizer, torch.optim.SGD):
        got = f"{name}, an adaptive optimizer whose update has its own moments"
    else:
        for group in optimizer.param_groups:
            if group.get("momentum", 0) or group.get("nesterov", False):
                got = f"SGD(momentum={group['momentum']!r}, nesterov={group['nesterov']!r})"
                break
    if got is not None:
        raise ConfigError(
            f"EASGD(momentum={spec.momentum!r}) is MEASGD's momentum on the local SGD update "
            f"(v <- mu v - lr g, the elastic term kept out of v) and needs "
            f"torch.optim.SGD without momentum of its own; got {got}. Pass "
            f"torch.optim.SGD(lr=...) as the optimizer, or EASGD(momentum=0.0) to keep {name}"
        )


def _number(value: Any, low: float, high: float) -> bool:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    return ok and low <= value <= high


class EasgdReplicas(Strategy):
    """One replica of EASGD: local steps, an elastic exchange every tau steps."""

    local_loss = True  # the replicas hold different models: each step's loss is its own
    name = "easgd"

    def __init__(self, spec: EASGD, ctx: Context) -> None:
        if spec.momentum and ctx.optimizer is not None:
            check_local_sgd(spec, ctx.optimizer)  # before any work: the reason, not a wrong run
        world = self.world = ctx.world
        self.spec, self.tied = spec, list(ctx.tied)
        self.params, self._moved, self.publish = moved_weights(ctx, "EASGD")
        self.replicas, self.replica = world.layout.data_parallel, world.replica
        self.alpha = spec.moving_rate(self.replicas)
        self.group = world.dp_group
        self.t = 0  # this replica's clock: steps done
        self.exchanges = 0
        self.comm = Collectives(getattr(world, "waits", None), ctx.timeline, "easgd")
        # every replica starts from the same weights; a checkpoint's load resets it from
        # the loaded ones (load_state_dict)
        self._center = flatten(self.params)
        self._round: tuple[torch.Tensor, Any] | None = None  # (sum, work): not yet applied
        self.velocity = torch.zeros_like(self._center) if spec.momentum else None
        self.dtype = torch.float32  # what a sync round sends: x_i, or x_i - x~ when lower
        if spec.mode == "sync" and self.group is not None and self.params:
            self.dtype = summable(self.comm, self.group, self.group, DOWNCAST[spec.downcast],
                                  "EASGD's rounds")  # fmt: skip
        self.hub = None
        self._viewing = False
        self._idle: list[int] = []  # this step's parameters without a gradient
        if spec.mode != "sync":
            from myelin.replicas.hub_client import connect_hub

            self.hub = connect_hub(world, ctx, self._center)

    # -- the hooks -------------------------------------------------------------

    def backwards_done(self, params: list[torch.nn.Parameter], loss: float) -> float:
        """On an exchange step, take x_i - x~ before the optimizer step; the loss is this
        replica's own (no collective: the replicas' mean is formed at fit's rows)."""
        self._before = flatten(self.params) if self.velocity is not None else None
        # SGD leaves a parameter without a gradient alone, and so does its momentum
        self._idle = [i for i, p in enumerate(params) if p.grad is None]
        self._pull = None  # e = alpha (x_i - x~) on an exchange step
        if self.t % self.spec.tau == 0 and self.params:
            x = flatten(self.params)
            self.exchanges += 1
            if self.spec.mode == "sync":
                self._settle()  # the last round's sum, into the center this pull needs
                if self.dtype == torch.float32:
                    total = x.clone()
                else:  # the difference, small, is what is rounded
                    total = (x - self._center).to(self.dtype)
                running = None
                if self.group is not None:  # runs until the center is next needed
                    running = self.comm.start(total, self.group, "exchange")
                self._round = (total, running)
                self._pull = self.alpha * (x - self._center)
            else:
                self._pull = self._hub_exchange(x)
        return loss

    def _hub_exchange(self, x: torch.Tensor) -> torch.Tensor:
        """One exchange with the hub, counted (bytes both ways, seconds waited); the pull."""
        sent, start = self.hub.bytes, time.perf_counter()
        if self.spec.mode == "async":
            old = self.hub.exchange(x, self.alpha)  # x~ moved by alpha (x - x~) there
            pull = self.alpha * (x - old.to(x.device))  # the hub's replies are host tensors
        else:
            pull = self.alpha * (x - self.hub.read().to(x.device))
            self.hub.push(pull)
        self.comm.count("exchange", self.hub.bytes - sent)
        self.comm.waited("exchange", time.perf_counter() - start)
        return pull

    def eval_loss(self, loss: float) -> float:
        if self.group is None:
            return loss
        return self.comm.loss(loss, self.group, self.replicas)

    def after_optimizer_step(self) -> None:
        """Momentum on the local update, then the elastic pull."""
        if not self.params:
            return
        if self.velocity is not None:
            x = flatten(self.params)
            spans = self._spans(self._idle)
            kept = [self.velocity[a:b].clone() for a, b in spans]
            self.velocity.mul_(self.spec.momentum).add_(x - self._before)
            x = self._before + self.velocity
            for (a, b), v in zip(spans, kept, strict=True):  # no gradient: neither moves
                self.velocity[a:b], x[a:b] = v, self._before[a:b]
            unflatten(x, self.params)
        if self._pull is not None:  # e = alpha (x_i - x~), taken before the step
            unflatten(flatten(self.params).sub_(self._pull), self.params)
            equalise(self.tied, self.world, self._moved)  # each stage's pull rounds its own
        if self.velocity is not None or self._pull is not None:
            self.publish()

    def _spans(self, indices: list[int]) -> list[tuple[int, int]]:
        """Where the parameters at `indices` lie in the flat vectors."""
        starts = [0]
        for p in self.params:
            starts.append(starts[-1] + p.numel())
        return [(starts[i], starts[i + 1]) for i in indices]

    def _settle(self) -> None:
        """Wait for the last sync round's sum and move the center by it:
        x~ <- x~ + alpha (sum_i x_i - p x~), or x~ + alpha sum_i d_i when downcast."""
        if self._round is None:
            return
        total, work = self._round
        self._round = None
        if work is not None:
            self.comm.wait(work, "exchange")
        if total.dtype == torch.float32:
            self._center.add_(self.alpha * (total - self.replicas * self._center))
        else:
            self._center.add_(total.float(), alpha=self.alpha)

    @property
    def in_flight(self) -> bool:
        """Whether the last sync round's all-reduce is not yet taken into the center."""
        return self._round is not None

    @property
    def center(self) -> torch.Tensor:
        """This rank's copy of the center (sync mode), the last round taken in."""
        self._settle()
        return self._center

    def step_end(self) -> None:
        self.t += 1
        if self.hub is not None:
            self.hub.check()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank put into sync rounds' all-reduces (x_i, or x_i - x~ downcast)."""
        return self.comm.traffic["exchange"].bytes if "exchange" in self.comm.traffic else 0

    def stats(self) -> dict[str, int]:
        sent = self.hub.bytes if self.hub is not None else self.bytes_sent
        return {"global_bytes": sent, "exchanges": self.exchanges}

    def traffic(self) -> dict[str, dict[str, float]]:
        return self.comm.summary()

    # -- what the model is ----------------------------------------------------

    def current_center(self) -> torch.Tensor:
        """x~ now: this rank's copy (sync) or the hub's."""
        return self.center if self.hub is None else self.hub.read()

    def agreed_center(self) -> torch.Tensor:
        """x~ as every replica of this stage sees it. Sync: the rounds' all-reduce makes it
        so. Hub: read once each replica's exchanges (hogwild's pushes too) have landed and
        before any replica exchanges again (bounded barriers over the replicas), else
        replicas would evaluate or save different centers, missing a slower one's steps."""
        if self.hub is None:
            return self.center
        self.hub.settle()
        self._barrier()
        center = self.hub.read()
        self._barrier()
        return center

    def _barrier(self) -> None:
        if self.replicas > 1:
            self.comm.all_reduce(torch.zeros(1), self.group, "exchange")

    @contextlib.contextmanager
    def model_view(self) -> Iterator[None]:
        """The parameters hold the center while open; the local x_i come back after. Every
        rank must enter it (a collective over the replicas under the hub)."""
        if not self.params or self._viewing:  # nested views: the outer one holds it
            yield
            return
        self._viewing = True
        try:
            with holding(self.params, self.agreed_center(), self.publish) as own:
                self._own = own  # what a save inside the view keeps as this rank's
                if self.tied:  # a tied weight: the first holder's center
                    equalise(self.tied, self.world, self._moved)
                    self.publish()
                yield
        finally:
            self._viewing = False

    def state_dict(self) -> dict[str, Any]:
        """x_i, the clock and the velocity, tagged "easgd"; the checkpoint's model entries
        hold x~."""
        local = self._own.clone() if self._viewing else flatten(self.params)  # x_i, not x~
        state: dict[str, Any] = {"strategy": self.name, "local": local, "t": self.t}
        state["exchanges"] = self.exchanges
        if self.velocity is not None:
            state["velocity"] = self.velocity.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The parameters were loaded with the checkpoint's model: it becomes the center.
        With EASGD's own state of this rank, x_i, the clock and the velocity come back;
        without it (another strategy's checkpoint, another layout) every replica starts
        afresh from the loaded parameters, x_i = x~, so no exchange pulls toward the
        weights the trainer was built with."""
        self._set_center(flatten(self.params))
        own = own_state(state, self.name, "t")
        if own is None:
            self.t = 0
            if self.velocity is not None:
                self.velocity.zero_()
            return
        unflatten(own["local"], self.params)
        self.publish()
        self.t, self.exchanges = int(own["t"]), int(own["exchanges"])
        if self.velocity is not None and "velocity" in own:
            self.velocity.copy_(own["velocity"])

    def _set_center(self, center: torch.Tensor) -> None:
        """x~ <- `center`: on every rank (sync; a round in flight is waited for and
        dropped), or in the hub, where replica 0 puts it and no replica exchanges before
        it has (a barrier over the replicas)."""
        if self.hub is None:
            round_, self._round = self._round, None
            if round_ is not None and round_[1] is not None:
                self.comm.wait(round_[1], "exchange")
            self._center = center
            return
        if self.replica == 0:
            self.hub.set(center)
        self._barrier()

    def close(self) -> None:
        try:  # no collective left in flight on a group about to be destroyed
            self._settle()
        except Exception:  # a peer lost: the trainer's error says so already
            self._round = None
        if self.hub is not None:
            self.hub.close()
            self.hub = None
