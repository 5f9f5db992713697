"""A model's weights as a HuggingFace folder: each rank reads, and writes, its stage only.

    names = full_names(model, stage_module)     # before placing: local key -> model keys
    load(module, names, "folder")               # this stage's tensors, nothing else
    save(world, module, layout, "folder", [model.config])  # each stage its file; rank 0 the rest

The folder is what `save_pretrained` writes and `from_pretrained` reads: config.json, and
model.safetensors or model-0000i-of-0000n.safetensors with model.safetensors.index.json
naming each tensor's file. Tensors carry the whole model's state_dict keys. Reading opens
only the files holding this stage's tensors and reads only those tensors' bytes, straight
into the stage's own (no mapping of the file, no copy), so a rank never holds another
stage's weights, nor its own twice.
A tensor tied under several keys (an embedding and its LM head) is written once, under
its first key, as HuggingFace writes it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from myelin import reshard
from myelin.checkpoint import CheckpointError
from myelin.errors import ConfigError
from myelin.runtime.group import World

__all__ = [
    "INDEX",
    "SINGLE",
    "check_folder",
    "configs_of",
    "full_names",
    "load",
    "require_safetensors",
    "save",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def require_safetensors(what: str) -> None:
    """A ConfigError saying what to install where the safetensors package is missing."""
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f"{what} reads and writes safetensors: pip install 'myelin[hf]'")


def check_folder(path: Any, what: str = "weights") -> Path:
    """A folder holding model.safetensors or an index of shards, or a ConfigError."""
    require_safetensors(what)
    if not isinstance(path, (str, os.PathLike)) or not path:
        raise ConfigError(f"{what}={path!r} must be a folder written by save_pretrained")
    folder = Path(path)
    if not (folder / SINGLE).is_file() and not (folder / INDEX).is_file():
        raise ConfigError(
            f"{what}={os.fspath(path)!r} holds neither {SINGLE} nor {INDEX}: pass a folder "
            f"written by save_pretrained (safetensors weights)"
        )
    return folder


def configs_of(model: Any) -> list[Any]:
    """What `save` writes beside the weights: the model's config and generation config,
    where it has them with a `save_pretrained` (as HuggingFace models do)."""
    parts = (getattr(model, "config", None), getattr(model, "generation_config", None))
    return [p for p in parts if callable(getattr(p, "save_pretrained", None))]


def full_names(model: Any, module: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key of `module` (a stage cut from `model`) -> the keys of the same
    tensor in the whole model's state_dict (several when tied). Call it before placing the
    stage: tensors are matched by identity."""
    if module is model:
        return {key: [key] for key in model.state_dict(keep_vars=True)}
    whole: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        whole.setdefault(id(t), []).append(key)
    return {key: whole.get(id(t), [key]) for key, t in module.state_dict(keep_vars=True).items()}


def load(
    module: nn.Module,
    names: dict[str, list[str]],
    path: str | os.PathLike,
    rename: Callable[[str], str] | None = None,
) -> list[str]:
    """Copy this stage's tensors from the folder into `module`; returns the files opened.

    Every tensor of the stage must be in the folder with its shape; what is missing or
    misshapen is named in one CheckpointError. `rename`: a folder key -> the model's, for
    folders whose names differ from the model's (hf/keys.py).
    """
    from safetensors import safe_open

    folder = check_folder(path)
    index = _index(folder)
    renamed = {}  # the model's key -> the folder's, where the folder's is renamed on load
    for saved in index if rename is not None else ():
        key = rename(saved)
        if key != saved and key not in index:
            renamed[key] = saved
    mine = module.state_dict(keep_vars=True)
    plan: dict[str, list[tuple[str, str]]] = {}
    missing = []
    for local, keys in names.items():
        key = next((k for k in keys if k in index), None)
        key = key or next((renamed[k] for k in keys if k in renamed), None)
        if key is None:
            missing.append(f"{keys[0]} {tuple(mine[local].shape)}")
        else:
            plan.setdefault(index[key], []).append((local, key))
    problems = [f"missing: {m}" for m in missing]
    with torch.no_grad():
        for file in sorted(plan):
            # safetensors checks the file; the bytes are read straight into the stage's
            # tensors, not through its mapping of the file (whose pages would count in
            # this rank's resident memory while it is open) nor through a copy.
            with (
                safe_open(str(folder / file), framework="pt", device="cpu") as f,
                open(folder / file, "rb") as fh,
            ):
                header, base = _header(fh)
                for local, key in plan[file]:
                    shape = tuple(header[key]["shape"])
                    if shape != tuple(mine[local].shape):
                        problems.append(
                            f"{key}: the folder has {shape}, the model {tuple(mine[local].shape)}"
                        )
                    elif header[key]["dtype"] in _DTYPES:
                        _read_into(fh, base, header[key], mine[local], folder / file, key)
                    else:  # a dtype the table lacks (float8, unsigned): safetensors reads it
                        mine[local].copy_(f.get_tensor(key))
    if problems:
        raise CheckpointError(
            f"{folder} does not match this stage of the model:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )
    return sorted(plan)


def save(
    world: World,
    module: nn.Module,
    layout: list[list[tuple]],
    path: str | os.PathLike,
    extras: Iterable[Any] = (),
    updater: Any = None,
) -> Path:
    """Write the model as a save_pretrained folder; every rank must call it. With the
    stage's `updater`, a parameter's fp32 master is written where one exists (half
    precision, optimizer offload), in the dtype the model had when it was given.

    `layout` is `whole.state_layout`'s: per stage, (local key, model keys, shape,
    dtype). Replica 0's ranks each write their stage's file; then rank 0 writes the index
    and the `extras` (objects with a `save_pretrained(folder)`: an HF config, a generation
    config).
    """
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    files = _file_names([[e for e in entries if e[1]] for entries in layout])
    if world.replica == 0 and files[world.stage] is not None:
        state = reshard.export(module, updater)  # the true weights: masters in place
        tensors = {
            names[0]: state[local].detach().to("cpu", dtype).contiguous()
            for local, names, _, dtype in layout[world.stage]
            if names
        }
        tmp = folder / f".{files[world.stage]}.tmp-{os.getpid()}"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / files[world.stage])
    _barrier(world)
    if world.rank == 0:
        if len([f for f in files if f]) > 1:
            weight_map = {
                names[0]: files[s]
                for s, entries in enumerate(layout)
                for _, names, _, _ in entries
                if names
            }
            total = sum(
                _nbytes(shape, dtype)
                for entries in layout
                for _, names, shape, dtype in entries
                if names
            )
            text = json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
            )
            (folder / INDEX).write_text(text + "\n")
        _drop_stale(folder, {f for f in files if f})
        for extra in extras:
            extra.save_pretrained(folder)
    _barrier(world)
    return folder


def _drop_stale(folder: Path, written: set[str]) -> None:
    """Remove the weight files of an earlier save into `folder` that this one did not
    write (another layout's shards, or its index), so `from_pretrained` and `weights=`
    read this save's weights, as transformers' own save_pretrained cleans its folder."""
    stale = [p for p in folder.glob("model-*-of-*.safetensors") if p.name not in written]
    if SINGLE not in written:
        stale.append(folder / SINGLE)
    if len(written) == 1:
        stale.append(folder / INDEX)
    for p in stale:
        p.unlink(missing_ok=True)


def _file_names(stages: list[list[tuple]]) -> list[str | None]:
    """Per stage, the file it writes (None: nothing to write): model.safetensors alone, else
    model-0000i-of-0000n.safetensors."""
    writing = [s for s, entries in enumerate(stages) if entries]
    if len(writing) == 1:
        return [SINGLE if s in writing else None for s in range(len(stages))]
    n = len(writing)
    names = {s: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, s in enumerate(writing)}
    return [names.get(s) for s in range(len(stages))]


def _index(folder: Path) -> dict[str, str]:
    """Tensor key -> the file holding it."""
    if (folder / INDEX).is_file():
        try:
            return dict(json.loads((folder / INDEX).read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{folder / INDEX} is unreadable: {exc}") from None
    from safetensors import safe_open

    with safe_open(str(folder / SINGLE), framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), SINGLE)


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _header(fh: Any) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (already checked by safetensors) and where data starts."""
    size = int.from_bytes(fh.read(8), "little")
    return json.loads(fh.read(size)), 8 + size


def _read_into(
    fh: Any, base: int, entry: dict[str, Any], target: torch.Tensor, path: Path, key: str
) -> None:
    """Read one tensor's bytes from the file into `target` (through a buffer of the file's
    dtype only when the dtypes differ)."""
    dtype = _DTYPES[entry["dtype"]]
    start, end = entry["data_offsets"]
    direct = dtype == target.dtype and target.is_contiguous() and target.device.type == "cpu"
    buf = target if direct else torch.empty(target.shape, dtype=dtype)
    if end > start:
        fh.seek(base + start)
        got = fh.readinto(buf.reshape(-1).view(torch.uint8).numpy())
        if got != end - start:
            raise CheckpointError(f"{path}: {key} is cut short ({got} of {end - start} bytes)")
    if not direct:
        target.copy_(buf)


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _barrier(world: World) -> None:
    """Every rank at one point of save_pretrained; a lost peer ends it within seconds."""
    if world.layout.world_size > 1:
        if world.waits is not None:
            world.waits.barrier("save_pretrained")
        else:
            dist.barrier()
