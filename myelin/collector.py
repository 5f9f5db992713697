"""A trainer's long-lived objects kept out of the scans of Python's garbage collector.

Full collections scan every tracked object; with torch imported that is a few hundred
thousand, tens of milliseconds at random points of a step (0.8 s of a 40-step `myelin
train` on rank 0, issue 11.4). What is alive once a trainer has run its first
`AFTER_STEPS` steps (its optimizer state included) lives as long as it, so it moves to the
collector's permanent generation until the trainer closes; a profiled trainer freezes at
the end of the profiler's warm-up instead, so the steady state a profile measures has no
collection in it (the first steps' collections skewed the op times a profile replays). A
shorter run (a smoke test, an evaluation) never pays the full collection the freeze
starts with (0.1-0.2 s with torch imported, 0.3 s and more in a bigger process). Cycles
among frozen objects that die meanwhile are freed at the unfreeze, not before. The freeze
is the whole process's: where something froze objects already (the user, or another
trainer still open) a trainer leaves it as it is, and its close does not undo it.
"""

from __future__ import annotations

import gc

__all__ = ["AFTER_STEPS", "freeze", "unfreeze"]

AFTER_STEPS = 8  # training steps a trainer runs before it freezes what lives


def freeze() -> bool:
    """Collect once, then freeze every object alive now, unless objects are frozen already;
    True: the caller owes `unfreeze`."""
    if gc.get_freeze_count():  # (before the collection: a full pass costs 0.1-0.2 s)
        return False
    gc.collect()
    gc.freeze()
    return True


def unfreeze(froze: bool) -> None:
    """Give the frozen objects back to the collector, if this caller froze them."""
    if froze:
        gc.unfreeze()
