"""Sharded checkpoints that are either complete or ignored.

Layout of a checkpoint directory `path`:

    path/latest                    the name of the newest complete version ("step-00000120")
    path/step-00000120/rank0.pt    one shard per rank: its stage's parameters, optimizer
    path/step-00000120/rank1.pt    state, RNG state, step counters and the user's extra data
    path/step-00000120/manifest.json   written last, by rank 0, after a barrier

Every file is written to a temporary name, fsynced and renamed, and `latest` moves only
after the manifest is down, so a rank killed mid-save leaves the previous version
loadable. The manifest holds each shard's SHA-256 and the layers each stage held. Shards
hold state by layer (reshard.py), so a checkpoint loads into any stages x data_parallel
layout, each rank reading only the shards of its own layers; a corrupt shard or a model
that does not match is named on load, as is another optimizer class. A save at a step
`latest` already names goes to `step-N.1` (then `.2`, ...), never into the version a
resume would read; after a save the new version and the one before it are kept, and
versions past it (the future of a run that was resumed from an older one) are removed.
Shards hold tensors and plain data only: `torch.load(weights_only=True)` reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from myelin import checkpoint_versions as versions
from myelin import reshard
from myelin.atomic import write_atomic
from myelin.checkpoint_extra import check_extra
from myelin.errors import CheckpointError, ConfigError
from myelin.offload.optimizer import Updater
from myelin.runtime.group import World
from myelin.whole import gather, state_layout  # kept importable from here

__all__ = [
    "Checkpointable",
    "CheckpointError",
    "save",
    "load",
    "check_resume",
    "verify",
    "latest_version",
    "steps_saved",
    "state_layout",
    "gather",
]

log = logging.getLogger(__name__)

FORMAT = 2  # 2: state by layer (reshard.py), any layout loads it; 1: by stage, same layout
_SHARD_KEYS = {  # what a shard of each format must hold
    1: ("model", "optimizer", "rng"),
    2: ("steps_done", "seq", "rng", "extra", "model", "optimizer", "streams"),
}


class Checkpointable(Protocol):
    """What a checkpoint saves and restores of a trainer (`myelin.Trainer` is one)."""

    world: World  # the rank, its stage and replica, the layout
    module: nn.Module  # this rank's stage
    updater: Updater | None  # its optimizer state (None: nothing to train)
    streams: Any  # its layers' random streams (runtime/rng.py)
    lr_scheduler: Any  # None, or the scheduler over this stage's optimizer
    resumed_scheduler_state: Any  # set on load: the saved scheduler's, for one built later
    stage_layers: list[tuple[int, int] | None]  # the layers each stage holds
    steps_done: int  # training steps
    seconds_trained: float  # fit's time so far (a time budget's share goes on after a resume)
    seq: int  # training and evaluation steps: the step number the next messages carry
    checkpoint_version: Path | None  # the version last loaded or saved (pruning keeps its line)
    # (optional) replicas: the running replica strategy, whose state and model view count


def save(
    trainer: Checkpointable, path: str | os.PathLike, extra: dict[str, Any] | None = None
) -> Path:
    """Write this rank's shard, then (rank 0) the manifest; every rank must call it."""
    check_extra(extra)  # before anything is written: a shard resume cannot read loses all
    root = Path(path)
    world = trainer.world
    version = versions.new_name(root, trainer.steps_done)
    vdir = root / version
    vdir.mkdir(parents=True, exist_ok=True)
    shard = {
        "format": FORMAT,
        "rank": world.rank,
        "stage": world.stage,
        "replica": world.replica,
        "steps_done": trainer.steps_done,
        "seconds_trained": trainer.seconds_trained,
        "seq": trainer.seq,
        **reshard.capture(trainer.module, trainer.updater, trainer.streams, trainer.lr_scheduler),
        "rng": _rng_state(),
        "extra": extra or {},
    }
    strategy = getattr(trainer, "replicas", None)
    if strategy is not None:  # the model is what the strategy says it is (EASGD: the center)
        shard["strategy"] = strategy.state_dict()
        view = getattr(trainer, "model_view", strategy.model_view)  # buffers made equal too
        with view():  # by layer key, as `capture` (and `restore`) name them
            shard["model"] = reshard.layer_weights(trainer.module)
    shard_file = vdir / f"rank{world.rank}.pt"
    _atomic_write(shard_file, lambda f: torch.save(shard, f))
    _barrier(world)
    if world.rank == 0:
        manifest = {
            "format": FORMAT,
            "steps_done": trainer.steps_done,
            "seconds_trained": trainer.seconds_trained,  # read without a shard (train.py)
            "stages": world.layout.stages,
            "data_parallel": world.layout.data_parallel,
            "layers": [list(r) if r is not None else None for r in trainer.stage_layers],
            "shards": {},
        }
        for r in range(world.layout.world_size):
            f = vdir / f"rank{r}.pt"
            if not f.exists():
                raise CheckpointError(f"rank {r} did not write its shard {f}")
            manifest["shards"][str(r)] = {"file": f.name, "sha256": _sha256(f)}
        text = json.dumps(manifest, indent=1).encode()
        _atomic_write(vdir / "manifest.json", lambda f: f.write(text))
        _atomic_write(root / "latest", lambda f: f.write(version.encode()))
        base = trainer.checkpoint_version  # the line this run continues, if in this folder
        mine = base is not None and base.resolve().parent == root.resolve()
        versions.prune(root, version, base.name if mine else None)
    _barrier(world)
    trainer.checkpoint_version = vdir
    return vdir


def check_resume(resume: Any) -> None:
    """`Trainer(resume=...)`: a checkpoint to resume from must exist before any work starts."""
    if resume is None:
        return
    if not isinstance(resume, (str, os.PathLike)) or not resume:
        raise ConfigError(f"resume={resume!r} must be a checkpoint directory")
    try:
        latest_version(resume)
    except CheckpointError as exc:
        raise ConfigError(f"resume={os.fspath(resume)!r}: {exc}") from None


def load(trainer: Checkpointable, path: str | os.PathLike) -> dict[str, Any]:
    """Restore this rank's stage, optimizer, random streams, scheduler, RNG and step
    counters, from the shards that hold its layers in any layout; returns the extra data
    of the shard that held this stage's first layer (in this replica, or replica 0)."""
    vdir = latest_version(path)
    manifest = _read_manifest(vdir)
    if manifest["format"] == 1:
        return _load_by_stage(trainer, vdir, manifest)
    world = trainer.world
    ranks, own_replica = _shards_to_read(trainer, vdir, manifest)
    shards = [_read_shard(vdir, manifest, r) for r in ranks]
    where = f"{vdir} (rank {world.rank}, stage {world.stage}, replica {world.replica})"
    try:
        unmoved = reshard.restore(
            trainer.module,
            trainer.updater,
            trainer.streams,
            shards,
            stream_shards=shards if own_replica else None,
            steps=shards[0]["steps_done"],
            where=where,
        )
        scheduler = reshard.scheduler_state(shards[0], trainer.updater, trainer.module)
    except reshard.ReshardError as exc:
        raise CheckpointError(str(exc)) from None
    if not own_replica:
        unmoved.append(
            f"{where}: saved with data_parallel={manifest['data_parallel']}, so replica "
            f"{world.replica} takes replica 0's extra data and process RNG state"
        )
    _restore_strategy(trainer, vdir, manifest, unmoved)
    for line in unmoved:
        log.warning("%s", line)
    trainer.resumed_scheduler_state = scheduler
    if scheduler is not None and trainer.lr_scheduler is not None:
        reshard.load_scheduler(trainer.lr_scheduler, scheduler, str(vdir))
    first = shards[0]
    _set_rng_state(first["rng"])
    trainer.steps_done = first["steps_done"]
    trainer.seconds_trained = first.get("seconds_trained", 0.0)  # (absent: an older one)
    trainer.seq = first["seq"]
    trainer.checkpoint_version = vdir  # the line a later save in its folder continues
    return first["extra"]


def _restore_strategy(
    trainer: Checkpointable, vdir: Path, manifest: dict[str, Any], unmoved: list[str]
) -> None:
    """The replica strategy's own state (EASGD's x_i and center, DASO's schedule) is this
    rank's: it comes back in the layout that wrote it, and starts afresh from the loaded
    parameters in another (the strategy is told so by an empty state)."""
    strategy = getattr(trainer, "replicas", None)
    if strategy is None:
        return
    state: dict[str, Any] = {}
    if _same_layout(trainer, manifest):
        state = _read_shard(vdir, manifest, trainer.world.rank).get("strategy", {})
    elif strategy.state_dict():
        unmoved.append(
            f"{vdir}: the replica strategy's own state was saved with stages="
            f"{manifest['stages']} x data_parallel={manifest['data_parallel']} and starts "
            f"afresh from the loaded weights in this layout"
        )
    strategy.load_state_dict(_strategy_state(strategy, state))


def _same_layout(trainer: Checkpointable, manifest: dict[str, Any]) -> bool:
    """Whether the checkpoint was saved by this layout and holds this rank's shard."""
    layout = trainer.world.layout
    same = (manifest["stages"], manifest.get("data_parallel")) == (
        layout.stages,
        layout.data_parallel,
    )
    return same and str(trainer.world.rank) in manifest["shards"]


def _strategy_state(strategy: Any, state: dict[str, Any]) -> dict[str, Any]:
    """`state`, or {} where another strategy saved it (its "strategy" tag names another),
    so no strategy reads another's state as its own."""
    tag = state.get("strategy")
    return {} if tag is not None and tag != getattr(strategy, "name", "") else state


def _shards_to_read(
    trainer: Checkpointable, vdir: Path, manifest: dict[str, Any]
) -> tuple[list[int], bool]:
    """The ranks whose shards hold this stage's layers (in this replica if the checkpoint
    had it, else replica 0), first layer first; and whether the replica is this one's."""
    world = trainer.world
    old_stages, old_dp = manifest["stages"], manifest["data_parallel"]
    own = world.replica < old_dp
    replica = world.replica if own else 0
    saved = manifest.get("layers")
    mine = trainer.stage_layers[world.stage]
    if mine is None or saved is None or None in saved:
        if old_stages != world.layout.stages:
            raise CheckpointError(
                f"{vdir} was saved with stages={old_stages}, this trainer has "
                f"stages={world.layout.stages}, and only a model split into layers (a "
                f"Sequential, a list of modules, pipeline_layers()) moves between layouts"
            )
        stages = [world.stage]
    else:
        total = trainer.stage_layers[-1][1]
        if saved[-1][1] != total:
            raise CheckpointError(
                f"{vdir} was saved from a model of {saved[-1][1]} layers, this one has {total}"
            )
        stages = [s for s, (a, b) in enumerate(saved) if a < mine[1] and mine[0] < b]
    return [replica * old_stages + s for s in stages], own


def _read_shard(vdir: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    entry = manifest["shards"].get(str(rank))
    if entry is None:
        raise CheckpointError(f"{vdir}/manifest.json lists no shard for rank {rank}")
    shard_file = vdir / entry["file"]
    _check_shard(shard_file, entry["sha256"])
    try:
        shard = torch.load(shard_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch raises many kinds for a file not its own)
        raise CheckpointError(
            f"{shard_file} is not a myelin shard torch can read with weights_only=True: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    needed = _SHARD_KEYS[manifest["format"]]
    missing = [k for k in needed if not isinstance(shard, dict) or k not in shard]
    if missing:
        raise CheckpointError(f"{shard_file} is not a myelin shard: it has no {missing}")
    return shard


def _load_by_stage(trainer: Checkpointable, vdir: Path, manifest: dict[str, Any]) -> dict:
    """A checkpoint of format 1 (by stage): loads only into the layout that wrote it."""
    world = trainer.world
    if manifest["stages"] != world.layout.stages:
        raise CheckpointError(
            f"{vdir} was saved with stages={manifest['stages']} by an earlier myelin, whose "
            f"checkpoints load only with the same stages; this trainer has "
            f"stages={world.layout.stages}"
        )
    rank = world.rank if str(world.rank) in manifest["shards"] else world.stage
    shard = _read_shard(vdir, manifest, rank)
    _check_model(trainer, shard["model"], vdir / f"rank{rank}.pt")
    trainer.module.load_state_dict(shard["model"])
    if trainer.updater is not None:
        trainer.updater.sync_from_params()
        if shard["optimizer"] is not None:
            trainer.updater.load_state_dict(shard["optimizer"])
    strategy = getattr(trainer, "replicas", None)
    if strategy is not None:  # another replica's shard, or another layout's: afresh
        state = shard.get("strategy", {}) if _same_layout(trainer, manifest) else {}
        strategy.load_state_dict(_strategy_state(strategy, state))
    _set_rng_state(shard["rng"])
    trainer.steps_done = shard["steps_done"]
    trainer.seconds_trained = shard.get("seconds_trained", 0.0)
    trainer.seq = shard["seq"]
    trainer.resumed_scheduler_state = shard["extra"].get("scheduler")  # fit kept it there
    return shard["extra"]


def verify(path: str | os.PathLike) -> Path:
    """The newest complete version under `path`, after checking every shard's checksum;
    raises CheckpointError naming the first missing or corrupt shard."""
    vdir = latest_version(path)
    manifest = _read_manifest(vdir)
    for _, entry in sorted(manifest["shards"].items(), key=lambda kv: int(kv[0])):
        _check_shard(vdir / entry["file"], entry["sha256"])
    return vdir


def _check_shard(shard_file: Path, sha256: str) -> None:
    if not shard_file.exists():
        raise CheckpointError(f"shard {shard_file} is missing")
    digest = _sha256(shard_file)
    if digest != sha256:
        raise CheckpointError(
            f"shard {shard_file} is corrupt or truncated: its SHA-256 is {digest[:16]}..., "
            f"the manifest says {sha256[:16]}..."
        )


def latest_version(path: str | os.PathLike) -> Path:
    """The newest complete version directory under `path` (or `path` itself if it is one)."""
    root = Path(path)
    if (root / "manifest.json").exists():
        return root
    pointer = root / "latest"
    if not pointer.exists():
        raise CheckpointError(f"no complete checkpoint at {root} (no 'latest' file)")
    vdir = root / pointer.read_text().strip()
    if not (vdir / "manifest.json").exists():
        raise CheckpointError(f"{pointer} names {vdir.name}, which has no manifest.json")
    return vdir


def _check_model(trainer: Checkpointable, state: dict[str, torch.Tensor], where: Path) -> None:
    """Raise naming every parameter that is missing, unexpected or of another shape."""
    problems = reshard.mismatches(trainer.module.state_dict(), state)
    if problems:
        stage = trainer.world.stage
        raise CheckpointError(
            f"{where} does not match stage {stage} of this model:{reshard.listed(problems)}"
        )


def steps_saved(path: str | os.PathLike) -> int:
    """The training steps the newest complete version under `path` holds (its manifest
    only: nothing else is read)."""
    return int(_read_manifest(latest_version(path))["steps_done"])


def seconds_saved(path: str | os.PathLike) -> float | None:
    """fit's training time the newest complete version under `path` holds (its manifest
    only); None for a checkpoint saved before manifests carried it."""
    seconds = _read_manifest(latest_version(path)).get("seconds_trained")
    return float(seconds) if isinstance(seconds, int | float) else None


def _read_manifest(vdir: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((vdir / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{vdir}/manifest.json is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (1, FORMAT):
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(
            f"{vdir}/manifest.json has format {found!r}, expected {FORMAT} (or 1)"
        )
    needed = ("stages", "shards") + (("data_parallel",) if manifest["format"] == FORMAT else ())
    missing = [k for k in needed if k not in manifest]
    if missing or not isinstance(manifest["shards"], dict):
        what = missing or "mapping of shards"
        raise CheckpointError(f"{vdir}/manifest.json is not a myelin manifest: it has no {what}")
    return manifest


def _atomic_write(target: Path, write) -> None:
    write_atomic(target, write, durable=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _barrier(world: World) -> None:
    """Every rank at one point of a save; a lost or departed peer ends it within seconds."""
    if world.layout.world_size > 1:
        if world.waits is not None:
            world.waits.barrier("a checkpoint save")
        else:
            dist.barrier()


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
