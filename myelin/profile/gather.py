"""Every rank's profile records on every rank, through the torch.distributed store.

Records travel as compressed JSON under per-call keys (never pickled); a rank that sends
nothing within the timeout is named as missing rather than waited for; one that is lost
or closed its trainer ends the gather within seconds with its name (world.waits).
"""

from __future__ import annotations

import json
import logging
import zlib
from datetime import timedelta
from typing import Any

from myelin.errors import DeadlineError

__all__ = ["gather"]

log = logging.getLogger(__name__)


def gather(
    record: dict[str, Any], world: Any, timeout_s: float = 60.0
) -> tuple[list[dict[str, Any]], list[int]]:
    """Every rank's record on every rank, through the torch.distributed store as JSON.

    Collective: every rank calls it. Returns the records and the ranks that sent none
    within `timeout_s` (a dead peer costs a timeout, never a hang).
    """
    size = world.layout.world_size
    if size == 1 or world.store is None:
        return [record], []
    store = world.store
    call = store.add(f"myelin/profile/calls/{world.rank}", 1)  # the same on every rank
    prefix = f"myelin/profile/{call}"
    store.set(f"{prefix}/{world.rank}", zlib.compress(json.dumps(record).encode(), 1))
    keys = [f"{prefix}/{r}" for r in range(size)]
    try:
        waits = getattr(world, "waits", None)
        if waits is not None:  # a lost or departed peer raises here, within seconds
            waits.keys(store, keys, "the profile gather", timeout_s)
        else:
            store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, DeadlineError):  # DistStoreError on timeout: take what came
        pass
    records, missing = [], []
    for r, key in enumerate(keys):
        if r == world.rank:
            records.append(record)
        elif store.check([key]):
            records.append(json.loads(zlib.decompress(store.get(key))))
        else:
            missing.append(r)
    if missing:
        log.warning("rank %d: no profile records from ranks %s", world.rank, missing)
    if store.add(f"{prefix}/read", 1) == size:  # the last reader cleans up
        for key in [*keys, f"{prefix}/read"]:
            store.delete_key(key)
    return records, missing
