"""Which waits the schedule implies: the bubble, told apart from latency, slow peers and sync.

A rank that waits for a message waits for one of several reasons. To tell them apart the
report replays the run as it should have gone (`simulate`): every rank runs the
operations it actually ran, in the order it ran them, for the time each took, with the
same time of its own between them within a step (sending, bookkeeping; not its script
between steps, nor a warm-up's tail: each step starts as the last one ends), but every
message arrives the instant the operation that produced it ends. The waits of that
replay are the ones the schedule implies; their share of the replay's wall time is the
**expected bubble**. Each real wait before an operation is then cut (`attribute`) into:

- `bubble`: up to the wait the replay had before that operation;
- `sync`: then what the ranks' time between steps (their scripts) added to it: the
  wait a second replay, in which each rank also pauses as it really did between its
  steps, has beyond the first;
- `latency`: of the rest, the time since the producing operation ended on the peer (the
  message on its way: the sender's hand-over, the transport, the receive);
- `sync`: the rest, for the first operation of a step, the optimizer step, or waits at a
  step's end (a neighbour still finishing the previous step, sends being drained);
- `slow_peer`: the rest otherwise: the peer produced the message later than the replay
  says it could have, because it was itself held up.

Only waits recorded with cause "bubble" (waiting for a message) are cut; collectives,
offload copies and host time keep their own causes.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from myelin.profile.spans import Span

__all__ = ["MESSAGE_CAUSES", "attribute", "simulate"]

MESSAGE_CAUSES = ("bubble", "latency", "slow_peer", "sync")
_OPS = {"forward": "F", "eval": "F", "backward": "B", "optimizer": "OPT"}
_WEIGHTS = re.compile(r"\d+W\d+$")  # `1W3`: a W; an I (`1I3`) sends as a B does


@dataclasses.dataclass(slots=True)
class _Op:
    span: Span
    key: tuple  # (step, replica, stage, kind, microbatch)
    needs: tuple | None  # the key of the operation whose message makes this one ready
    own: float = 0.0  # this rank's own time (not waiting for messages) before the op
    paused: float = 0.0  # before a step's first op: the rank's time since its last step
    waited: float = 0.0  # time really spent waiting for messages before the op
    start: float = 0.0  # in the replay
    end: float = 0.0
    expected: float = 0.0  # the replay's wait before the op


@dataclasses.dataclass(slots=True)
class _Rank:
    record: dict[str, Any]
    spans: list[Span]
    offset: float  # add to this rank's times to get the common clock
    ops: list[_Op]
    begin: float  # the window's start, this rank's clock
    waits: list[Span]  # cause "bubble" spans in the window, by start
    starts: list[float]  # their start times, to find them

    def waits_in(self, lo: float, hi: float) -> list[Span]:
        """The waits that start in [lo, hi) (a wait never straddles an operation)."""
        return self.waits[bisect.bisect_left(self.starts, lo) : bisect.bisect_left(self.starts, hi)]


def simulate(
    records: Sequence[dict[str, Any]], spans: dict[int, list[Span]], first_step: int | None
) -> dict[int, dict[str, Any]] | None:
    """The replay of steps >= first_step (all when None): per rank its `expected_bubble`
    and its operations with their replayed waits. None when it cannot be made (a rank's
    records are missing, or they do not fit together)."""
    ranks = _ranks(records, spans, first_step)
    if ranks is None:
        return None
    begins = _replay(ranks, pauses=False)
    if begins is None:
        return None  # an operation waits for one that never ran: records do not fit
    out = {}
    for r, rank in ranks.items():
        wall = rank.ops[-1].end - begins[r] if rank.ops else 0.0
        expected = sum(op.expected for op in rank.ops)
        out[r] = {"expected_bubble": expected / wall if wall > 0 else 0.0, "rank": rank}
    return out


def _replay(ranks: dict[int, _Rank], pauses: bool) -> dict[int, float] | None:
    """Replay the ranks' operations, setting each op's start, end and expected wait; with
    `pauses`, each rank also spends its real time between steps (`paused`). The window's
    first step is replayed twice: once from a common start, to put the ranks as far apart
    as the schedule leaves them at a step's end, then for real (a warm-up's slow tail is
    not the schedule's). Returns where each rank's window begins, None if ops never run."""
    queues = {r: [*_primer(rank.ops), *rank.ops] for r, rank in ranks.items()}
    done: dict[tuple, float] = {}
    prev = dict.fromkeys(ranks, 0.0)
    begins = dict(prev)
    at = dict.fromkeys(ranks, 0)
    while any(at[r] < len(queues[r]) for r in ranks):
        moved = False
        for r, queue in queues.items():
            while at[r] < len(queue):
                op = queue[at[r]]
                if op.needs is not None and op.needs not in done:
                    break
                free = prev[r] + op.own + (op.paused if pauses else 0.0)
                op.start = max(free, done.get(op.needs, free))
                op.expected = op.start - free
                op.end = op.start + (op.span.end - op.span.start)
                done[op.key] = prev[r] = op.end
                if op.key[0] == _PRIMER:
                    begins[r] = op.end
                at[r] += 1
                moved = True
        if not moved:
            return None
    return begins


def attribute(
    records: Sequence[dict[str, Any]], spans: dict[int, list[Span]], first_step: int | None
) -> tuple[dict[int, list[Span]], dict[int, float]] | None:
    """Every rank's spans with its message waits cut into MESSAGE_CAUSES, and each rank's
    expected bubble, over steps >= first_step; None when the replay cannot be made."""
    replay = simulate(records, spans, first_step)
    if replay is None:
        return None
    ranks = {r: entry["rank"] for r, entry in replay.items()}
    schedule = {op.key: op.expected for rank in ranks.values() for op in rank.ops}
    _replay(ranks, pauses=True)  # the waits the ranks' time between steps adds
    paused = {op.key: op.expected for rank in ranks.values() for op in rank.ops}
    ends = {op.key: op.span.end + rank.offset for rank in ranks.values() for op in rank.ops}
    out_spans, expected = {}, {}
    for r, entry in replay.items():
        rank = entry["rank"]
        expected[r] = entry["expected_bubble"]
        cut: dict[int, list[Span]] = {}  # id of a wait span -> its pieces
        lo = rank.begin
        for i, op in enumerate(rank.ops):
            waits = rank.waits_in(lo, op.span.start)
            lo = op.span.end
            if not waits:
                continue
            produced = ends.get(op.needs) if op.needs is not None else None
            first_of_step = i == 0 or rank.ops[i - 1].span.step != op.span.step
            rest = "sync" if produced is None or first_of_step else "slow_peer"
            arrived = waits[-1].end + rank.offset
            in_flight = max(0.0, arrived - produced) if produced is not None else 0.0
            # what the ranks' time between steps (their scripts) added to this wait
            late = max(0.0, paused[op.key] - schedule[op.key])
            _cut(waits, schedule[op.key], late, in_flight, rest, cut)
        for w in rank.waits_in(lo, float("inf")):  # after the last operation: step end
            cut[id(w)] = [dataclasses.replace(w, cause="sync")]
        out_spans[r] = [piece for s in rank.spans for piece in cut.get(id(s), [s])]
    return out_spans, expected


_PRIMER = "primer"  # the step of the copies `_primer` makes


def _primer(ops: list[_Op]) -> list[_Op]:
    """Copies of a rank's operations of its first step, under their own keys."""
    first = [op for op in ops if op.span.step == ops[0].span.step] if ops else []
    return [
        _Op(op.span, (_PRIMER, *op.key[1:]), (_PRIMER, *op.needs[1:]) if op.needs else None,
            op.own)  # fmt: skip
        for op in first
    ]


def _cut(
    waits: list[Span], bubble: float, late: float, latency: float, rest: str, out: dict
) -> None:
    """Label the waits before one operation, in time order: the first `bubble` seconds
    bubble, the next `late` seconds sync (the producer between its steps), the last
    `latency` seconds (of what is left) latency, the middle `rest`."""
    total = sum(w.end - w.start for w in waits)
    bubble = min(bubble, total)
    late = min(late, total - bubble)
    latency = min(latency, total - bubble - late)
    middle = total - bubble - late - latency
    bounds = [("bubble", bubble), ("sync", late), (rest, middle), ("latency", latency)]
    t = 0.0
    for w in waits:
        pieces = []
        a, b = t, t + (w.end - w.start)
        edge = 0.0
        for cause, length in bounds:
            lo, hi = max(a, edge), min(b, edge + length)
            if hi > lo:
                start = w.start + (lo - a)
                pieces.append(
                    dataclasses.replace(w, cause=cause, start=start, end=w.start + (hi - a))
                )
            edge += length
        out[id(w)] = pieces or [w]
        t = b


def _ranks(
    records: Sequence[dict[str, Any]], spans: dict[int, list[Span]], first_step: int | None
) -> dict[int, _Rank] | None:
    """Each rank's operations in the window, with the time of its own before each."""
    if not records or any(r.get("stage") is None for r in records):
        return None
    stages = max(r.get("stages") or r["stage"] + 1 for r in records)
    where = {(r.get("replica") or 0, r["stage"]) for r in records}
    if len(where) != len(records):
        return None
    base = _clock_base(records)
    out = {}
    for rec in records:
        rank, replica, stage = rec["rank"], rec.get("replica") or 0, rec["stage"]
        mine = [s for s in spans[rank] if first_step is None or s.step >= first_step]
        if not mine:
            continue
        begin = min(s.start for s in mine)
        ops, waits = [], []
        for s in sorted(mine, key=lambda s: s.start):
            kind = _OPS.get(s.kind)
            if kind == "B" and _WEIGHTS.match(s.name):  # a split backward's W: no message
                kind = "W"
            if kind is not None and s.cause is None:
                key = (s.step, replica, stage, kind, s.microbatch)
                needs = _needs(key, stages)
                if needs is not None and needs[1:3] not in where:
                    return None  # the rank that sends this operation's input sent no records
                ops.append(_Op(s, key, needs))
            elif s.kind == "wait" and s.cause == "bubble":
                waits.append(s)
        entry = _Rank(
            rec, spans[rank], _offset(rec, base), ops, begin, waits, [w.start for w in waits]
        )
        lo, step = begin, None
        earlier = [s.end for s in spans[rank] if first_step is not None and s.step < first_step
                   and s.cause is None and _OPS.get(s.kind)]  # fmt: skip
        if earlier:  # the window's first step: its pause since the step before it too
            lo, step = max(earlier), first_step - 1
        for op in ops:
            waited = sum(w.end - w.start for w in entry.waits_in(lo, op.span.start))
            op.waited = waited
            own = max(0.0, op.span.start - lo - waited)
            # between steps the time is the script's, not the schedule's: the replay
            # starts each step right after the last one (and, apart, with this pause)
            if op.span.step == step:
                op.own = own
            elif step is not None:
                op.paused = own
            lo, step = op.span.end, op.span.step
        out[rank] = entry
    return out if len(out) == len(records) else None


def _needs(key: tuple, stages: int) -> tuple | None:
    """The operation whose message makes `key` ready (None: ready from local data; a W
    follows its own I)."""
    step, replica, stage, kind, mb = key
    if kind == "F" and stage > 0:
        return (step, replica, stage - 1, "F", mb)
    if kind == "B" and stage < stages - 1:
        return (step, replica, stage + 1, "B", mb)
    return None


def _clock_base(records: Sequence[dict[str, Any]]) -> tuple[str, float]:
    """How ranks' times are put on one clock: the monotonic clock when every rank shares a
    host (exact), else wall-clock origins (as good as the hosts' clock sync)."""
    hosts = {r.get("host") for r in records}
    if len(hosts) == 1 and None not in hosts and all("mono_origin" in r for r in records):
        return "mono_origin", min(r["mono_origin"] for r in records)
    return "wall_origin", min(r.get("wall_origin", 0.0) for r in records)


def _offset(rec: dict[str, Any], base: tuple[str, float]) -> float:
    field, origin = base
    return rec.get(field, 0.0) - origin
