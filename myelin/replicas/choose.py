"""`Trainer(sync=...)`: a strategy's settings object, or its name for the defaults."""

from __future__ import annotations

from typing import Any

from myelin.errors import ConfigError
from myelin.replicas.allreduce import AllReduce
from myelin.replicas.daso import DASO
from myelin.replicas.easgd import EASGD
from myelin.replicas.hogbatch import Hogbatch

__all__ = ["STRATEGIES", "check_supported", "resolve_sync"]

STRATEGIES = {"allreduce": AllReduce, "daso": DASO, "easgd": EASGD, "hogbatch": Hogbatch}


def resolve_sync(sync: Any, stages: int, data_parallel: int) -> Any:
    """The settings object `sync` names or is, checked against the replicas."""
    if isinstance(sync, str):
        if sync.lower() not in STRATEGIES:
            raise ConfigError(f"sync={sync!r} must be one of {list(STRATEGIES)} or a strategy")
        sync = STRATEGIES[sync.lower()]()
    if not isinstance(sync, tuple(STRATEGIES.values())):
        raise ConfigError(
            f"sync={sync!r} must be myelin.AllReduce(), myelin.DASO(...), myelin.EASGD(...), "
            f"myelin.Hogbatch(...) or one of their names {list(STRATEGIES)}"
        )
    check = getattr(sync, "check", None)
    if check is not None:
        check(stages, data_parallel)
    return sync


def check_supported(
    sync: Any,
    optimizer_offload: bool,
    precision: str,
    *,
    activations_offload: bool = False,
    max_grad_norm: float | None = None,
    microbatches: int = 1,
) -> None:
    """DASO and EASGD move the fp32 masters (replicas/flat.py), which the parameters
    follow: MEASGD's velocity would coast through fp16's skipped steps. Hogbatch's workers
    train fp32 copies of the whole model with plain SGD steps: no offload, no half
    precision, no clipping by a global norm, no microbatches."""
    if sync.name == "allreduce":
        return
    if sync.name == "hogbatch":
        if microbatches != 1:
            raise ConfigError(
                f"Trainer(microbatches={microbatches}) with sync=Hogbatch(...): its workers "
                f"each train a whole batch of the size the strategy chose (device_batch, "
                f"cpu_batch), never split; leave microbatches at its default (1)"
            )
        offload = "OffloadConfig(...)" if optimizer_offload or activations_offload else None
        for field, value, plain in (
            ("offload", offload, None),
            ("precision", precision, "fp32"),
            ("max_grad_norm", max_grad_norm, None),
        ):
            if value != plain:
                raise ConfigError(
                    f"Trainer({field}={value!r}) with sync=Hogbatch(...): its workers add "
                    f"plain fp32 SGD steps to one shared model in host memory, so there is "
                    f"nothing to offload, no half precision and no global clipping; leave "
                    f"{field} at its default ({plain!r})"
                )
        return
    if getattr(sync, "momentum", 0.0) and precision == "fp16":
        raise ConfigError(
            f"sync=EASGD(momentum={sync.momentum}) with precision='fp16': MEASGD's velocity "
            f"would coast through the steps fp16's loss scaling skips; use precision='bf16' "
            f"(no loss scaling) or 'fp32'"
        )
