"""Which version directory a checkpoint save writes, and which versions stay after it.

Versions are `step-00000120`, or `step-00000120.2` for a later save at the same step:
a save never writes into the version `latest` names, which a resume would read."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["KEEP", "new_name", "prune"]

KEEP = 2  # complete versions kept; older ones are removed after a successful save


def new_name(root: Path, steps: int) -> str:
    """This save's directory: `step-N`, or `step-N.k` when `latest` names step N already
    (every rank reads the same `latest`: the last save moved it before its final barrier)."""
    name = f"step-{steps:08d}"
    order = _order(_latest_name(root) or "")
    if order is None or order[0] != steps:
        return name
    return f"{name}.{order[1] + 1}"


def prune(root: Path, keep: str, base: str | None = None) -> None:
    """Keep `keep` and the KEEP - 1 versions before it on its run's line; remove the rest.
    `base`: the version this run last loaded or saved in `root`; versions after it but
    `keep` are another line's (a run resumed from an older version abandoned them), as
    are versions past `keep`."""
    found = sorted(
        (order, p) for p in root.glob("step-*") if p.is_dir() and (order := _order(p.name))
    )
    mine = _order(keep)
    floor = _order(base) if base is not None else None
    if floor is None or floor > mine:
        floor = mine
    older = [p for order, p in found if order < mine and order <= floor]
    abandoned = [p for order, p in found if order > mine or floor < order < mine]
    for old in older[: max(0, len(older) - (KEEP - 1))] + abandoned:
        shutil.rmtree(old, ignore_errors=True)


def _latest_name(root: Path) -> str | None:
    try:
        return (root / "latest").read_text().strip() or None
    except OSError:
        return None


def _order(name: str) -> tuple[int, int] | None:
    """`step-00000120` -> (120, 0), `step-00000120.2` -> (120, 2); None if not a version."""
    step, _, again = name.removeprefix("step-").partition(".")
    if not name.startswith("step-") or not step.isdigit() or not (again or "0").isdigit():
        return None
    return int(step), int(again or 0)
