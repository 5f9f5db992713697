"""A rank's links to the others: the transport to its neighbour stages and heartbeats with
every rank, both keyed by a generation so a second trainer in one script meets fresh keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from myelin.runtime.flight import FlightRecorder
from myelin.runtime.group import World
from myelin.runtime.liveness import Liveness
from myelin.runtime.transport import Transport, TransportConfig

__all__ = ["connect_peers"]


def connect_peers(
    world: World,
    stages: int,
    config: TransportConfig,
    flight: FlightRecorder,
    flight_dir: Callable[[], Path],
) -> tuple[Transport, Liveness]:
    """The transport, connected to the stages before and after this one, and heartbeats."""
    generation = world.store.add(f"myelin/trainers/{world.rank}", 1)
    transport = Transport(
        world.rank,
        world.layout.world_size,
        world.store,
        config,
        prefix=f"myelin/t{generation}",
        same_host=world.same_host,
    )
    try:
        peers = [world.peer(s) for s in (world.stage - 1, world.stage + 1) if 0 <= s < stages]
        transport.connect(peers)
        liveness = Liveness(
            world.rank,
            world.layout.world_size,
            world.layout.describe,
            world.store,
            transport,
            flight,
            heartbeat_s=config.heartbeat_s,
            peer_timeout_s=config.peer_timeout_s,
            exit_after_loss_s=config.exit_after_loss_s,
            connect_timeout_s=config.connect_timeout_s,
            prefix=f"myelin/t{generation}",
            flight_dir=flight_dir,
        )
    except BaseException:
        transport.close()
        raise
    # the goodbye of a rank connected to this inbox (a neighbour, or one that sent to it)
    # explains its connection closing; the others' would explain nothing
    transport.closed.parted = lambda: liveness.parted({*peers, *transport.heard_from})
    return transport, liveness
