"""The figures of a profile: per rank busy and idle shares over the steady-state steps.

    summary = summarize(records, spans_by_rank, warmup_steps=1)   # shaped as summary.json
    print(format_summary(summary))                                 # one row per rank

Figures are fractions of each rank's wall time (from its first record of a step to its
last), over the steady-state steps (after `warmup_steps`) and over the whole run. Waits
for messages are first split into the bubble the schedule implies and the rest
(attribution.py), and each rank's `expected_bubble` is the one a replay of its
schedule, with the measured op times and instant messages, had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from myelin.profile.accounting import HTA_CAUSES, Interval, account, add_seconds, fractions, seconds
from myelin.profile.attribution import attribute
from myelin.profile.spans import Span

__all__ = [
    "SUMMARY_FORMAT",
    "format_communication",
    "format_summary",
    "pct",
    "steady",
    "steps_of",
    "summarize",
]

SUMMARY_FORMAT = "myelin-profile-summary"


def steps_of(spans: Mapping[int, Sequence[Span]]) -> list[int]:
    """Every step number any rank recorded, in order."""
    return sorted({s.step for rank_spans in spans.values() for s in rank_spans})


def steady(steps: list[int], warmup_steps: int) -> list[int]:
    """The steps after warm-up (all steps when there are no more than `warmup_steps`)."""
    return steps[warmup_steps:] if len(steps) > warmup_steps else steps


def _evaluations(spans: Mapping[int, Sequence[Span]], steps: list[int]) -> int:
    """How many of `steps` were evaluation steps (the trainer numbers them with training's,
    so a user reading "steps 1-841" after 714 training steps sees where the rest went)."""
    if not steps:
        return 0
    low, high = steps[0], steps[-1]
    evals = {s.step for rs in spans.values() for s in rs if s.kind == "eval" and s.step >= low}
    trains = {s.step for rs in spans.values() for s in rs if s.kind in ("forward", "backward")}
    return len({step for step in evals - trains if step <= high})


def summarize(
    ranks: Sequence[dict[str, Any]],
    spans: Mapping[int, Sequence[Span]],
    warmup_steps: int,
    missing: Sequence[int] = (),
) -> dict[str, Any]:
    """The figures of every rank's records, shaped as summary.json: {"ranks": [...], ...}.
    A record whose older spans were folded into totals (profile/window.py) adds them."""
    folded_steps = {s for rec in ranks for s in (rec.get("folded") or {}).get("first_steps", ())}
    all_steps = sorted(set(steps_of(spans)) | folded_steps)
    steady_steps = steady(all_steps, warmup_steps)
    source = ranks[0].get("source", "myelin") if ranks else "myelin"
    expected: dict[int, float] = {}
    whole_spans = spans  # the whole run's waits, attributed over every step (warm-up too)
    if source == "myelin" and steady_steps and not missing:
        cut = attribute(ranks, spans, steady_steps[0])  # the bubble apart from other waits
        whole = attribute(ranks, spans, all_steps[0]) if all_steps[0] < steady_steps[0] else cut
        if cut is not None:
            spans, expected = cut
        if whole is not None:
            whole_spans = whole[0]
    rows = []
    for rec in ranks:
        rank_spans = spans[rec["rank"]]
        row = {k: rec.get(k) for k in ("rank", "stage", "replica", "device", "source")}
        mine = rec.get("source", "myelin") == "myelin"
        how = {"host_device": mine and _on_host(rec.get("device")), "hta": not mine}
        folded = rec.get("folded")
        first = steady_steps[0] if steady_steps else None
        if folded is not None and not _same_warmup(folded, first):
            row["steady_state_from"] = "the kept window"  # its totals left out another warmup
        row.update(_figures(rank_spans, first, folded, how, steady=True))
        row["steps"] = [steady_steps[0], steady_steps[-1]] if steady_steps else []
        row["whole_run"] = _figures(whole_spans[rec["rank"]], None, folded, how, steady=False)
        if rec["rank"] in expected:
            row["expected_bubble"] = expected[rec["rank"]]
        if rec.get("detail"):
            row["detail"] = rec["detail"]
        rows.append(row)
    return {
        "format": SUMMARY_FORMAT,
        "version": 1,
        "source": source,
        "world_size": len(ranks) + len(missing),
        "missing_ranks": sorted(missing),
        "warmup_steps": warmup_steps,
        "steps": [all_steps[0], all_steps[-1]] if all_steps else [],
        "steady_steps": [steady_steps[0], steady_steps[-1]] if steady_steps else [],
        "eval_steps": None if folded_steps else _evaluations(spans, steady_steps),
        "ranks": rows,
        "mean": _mean(rows),
    }


def _figures(
    spans: Sequence[Span],
    first_step: int | None,
    folded: dict[str, Any] | None,
    how: dict[str, bool],
    steady: bool,
) -> dict[str, Any]:
    """`account` from the first record of `first_step` (None: of anything) to the last,
    the folded totals of older spans added (steady: the steady state's)."""
    if folded is None:
        return account(spans, *(_window(spans, first_step) or (0.0, 0.0)), **how)
    until = folded["until"]
    end = max([until, *(s.end for s in spans)])
    before, start = folded["whole"], until
    if steady:
        starts = [s.start for s in spans if first_step is not None and s.step >= first_step]
        if folded.get("steady_start") is not None:
            starts.append(folded["steady_start"])
        start = max(until, min(starts, default=until))
        before = folded["steady"] if _same_warmup(folded, first_step) else None
    part = seconds(spans, start, max(start, end), **how)
    return fractions(part if before is None else add_seconds(before, part))


def _same_warmup(folded: dict[str, Any], first_step: int | None) -> bool:
    """Whether the folded steady totals began where this report's steady state begins."""
    firsts, warmup = folded.get("first_steps", []), folded.get("warmup_steps")
    return (
        first_step is not None
        and warmup is not None
        and warmup < len(firsts)
        and (firsts[warmup] == first_step)
    )


def _window(spans: Sequence[Span], first_step: int | None = None) -> Interval | None:
    """From the first record of `first_step` (or of anything) on to the last record."""
    chosen = [s for s in spans if first_step is None or s.step >= first_step]
    if not chosen:
        return None
    return min(s.start for s in chosen), max(s.end for s in chosen)


def _on_host(device: str | None) -> bool:
    """Whether records of this device are host times (CPU) rather than device times."""
    return device is None or not str(device).startswith("cuda")


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {}
    keys = list(dict.fromkeys(k for r in rows for k in r["idle"]))
    overlaps = [r["overlap_frac"] for r in rows if r["overlap_frac"] is not None]
    mean = {
        "wall_s": sum(r["wall_s"] for r in rows) / len(rows),
        "busy_frac": sum(r["busy_frac"] for r in rows) / len(rows),
        "idle": {k: sum(r["idle"].get(k, 0.0) for r in rows) / len(rows) for k in keys},
        "overlap_frac": sum(overlaps) / len(overlaps) if overlaps else None,
    }
    if all("expected_bubble" in r for r in rows):
        mean["expected_bubble"] = sum(r["expected_bubble"] for r in rows) / len(rows)
    return mean


_SHORT = {
    "bubble": "bubble",
    "slow_peer": "slow-peer",
    "offload_wait": "offload",
    "collective_wait": "collect.",
    "optimizer_host": "opt-host",
    "host_overhead": "host",
    "host_wait": "host-wait",
    "short_gap": "short-gap",
    "other": "other",
}


def format_summary(summary: dict[str, Any]) -> str:
    """summary.json as a table: per rank, busy and idle causes in % of its wall time."""
    rows = summary["ranks"]
    keys = list(dict.fromkeys(k for r in rows for k in r["idle"]))
    if summary["source"] != "myelin":  # causes that no record of an imported trace can have
        keys = [k for k in keys if any(r["idle"][k] for r in rows) or k in HTA_CAUSES]
    shown = ["expected" if k == "expected" else _SHORT.get(k, k) for k in keys]
    if all("expected_bubble" in r for r in rows) and "bubble" in keys:
        keys.insert(keys.index("bubble") + 1, "expected")  # the bubble the schedule implies
        shown = ["expected" if k == "expected" else _SHORT.get(k, k) for k in keys]
    head = ["rank", "stage", "wall s", "busy", *shown, "overlap"]

    def cell(r: dict[str, Any], k: str) -> str:
        if k == "expected":
            return pct(r["expected_bubble"]) if "expected_bubble" in r else "-"
        return pct(r["idle"].get(k, 0.0))

    def line(r: dict[str, Any], label: str) -> list[str]:
        cells = [label, "-" if r.get("stage") is None else str(r["stage"]), f"{r['wall_s']:.3f}"]
        cells += [pct(r["busy_frac"])] + [cell(r, k) for k in keys]
        return cells + ["-" if r["overlap_frac"] is None else pct(r["overlap_frac"])]

    table = [head] + [line(r, str(r["rank"])) for r in rows]
    if len(rows) > 1:
        table.append(line(summary["mean"], "mean"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    text = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    steps = summary["steady_steps"]
    title = f"{summary['source']} profile: {len(rows)} rank(s), % of each rank's wall time"
    if steps:
        title += f" over steps {steps[0]}-{steps[1]}"
        if summary.get("eval_steps"):
            title += f" ({summary['eval_steps']} of them evaluation, numbered with training's)"
        if summary["warmup_steps"] and summary["steps"] and summary["steps"][0] < steps[0]:
            title += f" (after {summary['warmup_steps']} warm-up)"
        elif summary["warmup_steps"]:  # steady() keeps every step of a run this short
            title += (
                f" (every step: the run has no more than the {summary['warmup_steps']} "
                f"warm-up steps to leave out)"
            )
    if summary.get("missing_ranks"):
        title += f"; ranks {summary['missing_ranks']} sent no records"
    return "\n".join([title, *text, *format_communication(rows)])


def format_communication(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The replica strategy's communication per rank and kind (whole run), as table lines;
    none when no rank recorded any (one replica)."""
    table = []
    for r in rows:
        comm = (r.get("detail") or {}).get("communication")
        for kind, t in (comm or {}).get("traffic", {}).items():
            cells = [str(r["rank"]), comm["strategy"], kind, _size(t["bytes"]), str(t["count"])]
            table.append([*cells, f"{t['wait_s']:.3f}"])
    if not table:
        return []
    head = ["rank", "sync", "kind", "bytes", "count", "wait s"]
    widths = [max(len(row[i]) for row in [head, *table]) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [head, *table]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    title = "replica communication (whole run): bytes each rank put in, collectives, time waited"
    return ["", title, *lines]


def _size(n: float) -> str:
    """A byte count for people: 512 B, 1.9 KiB, 330.8 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal: 0.123 -> '12.3%'."""
    return f"{100 * x:.1f}%"
