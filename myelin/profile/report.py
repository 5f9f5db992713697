"""Where every rank's time went: `ProfileReport`, made from every rank's records.

    report = ProfileReport.from_ranks([collect(timeline) for each rank])
    report.print()                 # one row per rank: busy, idle by cause, overlap
    report.save("out/")            # summary.json, trace.json, timeline.png, ranks/rank{r}.json
    myelin profile out/            # the table again, and the picture redrawn

The figures come from `summary.py` (over `accounting.py`), the trace from `trace.py`, the
picture from `picture.py`; records are exchanged by `gather.py`. This module assembles
them: a report from records, from every rank of a live run (`gather_report`), at a
trainer's close (`finish_profile`), or read back from a directory (`load`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from myelin.errors import ConfigError, MyelinError, PeerLostError
from myelin.profile.accounting import CAUSES, account, merge_intervals
from myelin.profile.config import ProfileConfig
from myelin.profile.gather import gather
from myelin.profile.picture import MissingMatplotlib, plot_timeline
from myelin.profile.records import RANK_FORMAT, collect, spans_of, write_json
from myelin.profile.summary import format_summary, steady, steps_of, summarize
from myelin.profile.timeline import Span
from myelin.profile.trace import chrome_trace

__all__ = [
    "CAUSES",
    "ProfileConfig",
    "ProfileReport",
    "account",
    "chrome_trace",
    "collect",
    "finish_profile",
    "format_summary",
    "gather",
    "gather_report",
    "load",
    "merge_intervals",
    "plot_timeline",
]

log = logging.getLogger(__name__)


class ProfileReport:
    """Every rank's records and the figures derived from them."""

    def __init__(
        self,
        ranks: Sequence[dict[str, Any]],
        warmup_steps: int = 1,
        missing: Sequence[int] = (),
    ) -> None:
        if type(warmup_steps) is not int or warmup_steps < 0:
            raise ConfigError(f"warmup_steps={warmup_steps!r} must be an int >= 0")
        seen = [r["rank"] for r in ranks]
        if len(set(seen)) != len(seen):
            raise MyelinError(f"a profile holds each rank once, got ranks {sorted(seen)}")
        self.ranks = sorted(ranks, key=lambda r: r["rank"])
        self.warmup_steps = warmup_steps
        self.missing = sorted(missing)
        self._spans = {r["rank"]: spans_of(r) for r in self.ranks}
        self._summary: dict[str, Any] | None = None

    @classmethod
    def from_ranks(
        cls, ranks: Sequence[dict[str, Any]], warmup_steps: int = 1, missing: Sequence[int] = ()
    ) -> ProfileReport:
        """A report of rank records (from `collect` or the torch.profiler import)."""
        return cls(ranks, warmup_steps, missing)

    @property
    def source(self) -> str:
        return self.ranks[0].get("source", "myelin") if self.ranks else "myelin"

    def spans(self, rank: int) -> list[Span]:
        return self._spans[rank]

    @property
    def steps(self) -> list[int]:
        """Every step number any rank recorded, in order."""
        return steps_of(self._spans)

    @property
    def steady_steps(self) -> list[int]:
        """The steps after warm-up (all steps when there are no more than `warmup_steps`)."""
        return steady(self.steps, self.warmup_steps)

    def summary(self) -> dict[str, Any]:
        """The figures, shaped as summary.json: {"ranks": [{rank, stage, wall_s, ...}], ...}."""
        if self._summary is None:
            self._summary = summarize(self.ranks, self._spans, self.warmup_steps, self.missing)
        return self._summary

    def format(self) -> str:
        """The summary as a plain-text table, one row per rank."""
        return format_summary(self.summary())

    def print(self, file: TextIO | None = None) -> None:
        print(self.format(), file=file or sys.stdout)

    def trace(self) -> dict[str, Any]:
        """The Chrome trace (Trace Event Format) that Perfetto and chrome://tracing open."""
        return chrome_trace(self)

    def plot(self, path: str | os.PathLike[str], steps: Sequence[int] | None = None) -> Path:
        """Draw the PNG timeline; needs matplotlib."""
        return plot_timeline(self, path, steps)

    def save(self, out_dir: str | os.PathLike[str], plot: bool = True) -> dict[str, Path]:
        """Write summary.json, trace.json, timeline.png and ranks/rank{r}.json under `out_dir`."""
        out = Path(out_dir)
        (out / "ranks").mkdir(parents=True, exist_ok=True)
        paths = {}
        for rec in self.ranks:
            paths[f"rank{rec['rank']}"] = write_json(out / "ranks" / f"rank{rec['rank']}.json", rec)
        # an earlier run's ranks that this one has not (a directory reused with fewer
        # ranks) would be read back as this run's
        mine = {rec["rank"] for rec in self.ranks}
        _drop_ranks(out, lambda r: r not in mine)
        paths["summary"] = write_json(out / "summary.json", self.summary(), indent=1)
        paths["trace"] = write_json(out / "trace.json", self.trace())
        if plot and not self.steps:
            log.info("profile: no steps were recorded, so no timeline is drawn")
        elif plot:
            try:
                paths["timeline"] = self.plot(out / "timeline.png")
            except MissingMatplotlib as exc:
                log.warning("%s", exc)
        return paths


def load(path: str | os.PathLike[str], warmup_steps: int | None = None) -> ProfileReport:
    """Read back a profile directory written by `ProfileReport.save` (or its summary.json)."""
    root = Path(path)
    if root.is_file():
        root = root.parent
    files = sorted((root / "ranks").glob("rank*.json"))
    if not files:
        raise MyelinError(f"{root} holds no ranks/rank*.json: not a myelin profile directory")
    records = [json.loads(f.read_text()) for f in files]
    for f, rec in zip(files, records):
        if rec.get("format") != RANK_FORMAT:
            raise MyelinError(f"{f} is not a myelin rank profile (format={rec.get('format')!r})")
    summary = root / "summary.json"
    saved = json.loads(summary.read_text()) if summary.exists() else {}
    if warmup_steps is None:
        warmup_steps = saved.get("warmup_steps", 1)
    return ProfileReport(records, warmup_steps, saved.get("missing_ranks", ()))


def gather_report(
    timeline: Any,
    world: Any,
    sampler: Any = None,
    config: ProfileConfig | None = None,
) -> ProfileReport:
    """Every rank's profile so far, as one report on every rank (collective)."""
    config = config or ProfileConfig()
    counters = sampler.counters if sampler is not None else None
    record = collect(
        timeline, counters, device=getattr(world, "device", None), replica=world.replica
    )
    records, missing = gather(record, world, config.gather_timeout_s)
    return ProfileReport.from_ranks(records, config.warmup_steps, missing)


def finish_profile(
    timeline: Any,
    world: Any,
    sampler: Any = None,
    config: ProfileConfig | None = None,
    failed: bool = False,
) -> ProfileReport | None:
    """At close: stop sampling, gather, and on rank 0 print and save the report.

    After a failure (`failed`) peers may be gone, so each rank saves only its own
    records. Raises only PeerLostError (a peer lost or gone during the gather): anything
    else about a profile must not turn a clean close into an error.
    """
    config = config or ProfileConfig()
    try:
        if sampler is not None:
            sampler.stop()
        if failed:
            record = collect(timeline, sampler.counters if sampler is not None else None)
            report = ProfileReport.from_ranks([record], config.warmup_steps)
            if config.out_dir is not None:
                _save_own(Path(config.out_dir), record, world)
            return report
        report = gather_report(timeline, world, sampler, config)
    except PeerLostError:  # a lost peer is the rank's error, raised wherever it is
        raise
    except Exception as exc:  # a peer's own failure (RemoteError) needs no traceback here
        tb = not isinstance(exc, MyelinError)
        log.warning("rank %d: could not finish the profile: %s", world.rank, exc, exc_info=tb)
        return None
    try:  # the report is kept whatever becomes of its files
        if world.rank == 0:
            if config.print_summary:
                report.print()
            if config.out_dir is not None:
                report.save(config.out_dir)
                log.info("profile written to %s", config.out_dir)
    except Exception as exc:
        log.warning("rank %d: could not write the profile: %s", world.rank, exc, exc_info=True)
    return report


def _save_own(out: Path, record: dict[str, Any], world: Any) -> None:
    """After a failure, this rank's record alone; what an earlier run left in a reused
    directory (its summary, trace and picture, ranks this run has not) goes, so it is not
    read back as this run's."""
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    write_json(out / "ranks" / f"rank{world.rank}.json", record)
    _drop_ranks(out, lambda r: r >= world.layout.world_size)
    if world.rank == 0:
        for name in ("summary.json", "trace.json", "timeline.png"):
            (out / name).unlink(missing_ok=True)


def _drop_ranks(out: Path, stale: Callable[[int], bool]) -> None:
    """Remove ranks/rank{r}.json for each rank `stale(r)` names: an earlier run's, which
    would be read back as this run's (every rank may be saving here at once)."""
    for path in (out / "ranks").glob("rank*.json"):
        found = re.fullmatch(r"rank(\d+)\.json", path.name)
        if found and stale(int(found.group(1))):
            path.unlink(missing_ok=True)
