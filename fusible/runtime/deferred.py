"""The queue of deferred weight gradients (a split backward's wgrad lane).

A dgrad stage appends one entry per call: the token of its
:class:`~fusible.planning.prepare.WgradTarget`, the args record its wgrad reads (the
saved input, ``dy`` as the dgrad used it: under FP8 its E5M2 copies) and whether it ran
in a compiled graph (then the wgrad runs through its custom op too). The compiled path
appends from inside the dgrad stage's custom op, so the record never crosses the graph.
"""

from __future__ import annotations

import threading

_state = threading.local()


def queue() -> list:
    """This thread's entries ``(target token, record, compiled)``, oldest first."""
    entries = getattr(_state, "entries", None)
    if entries is None:
        entries = _state.entries = []
    return entries


def defer(token: int, record, compiled: bool) -> None:
    """Queue one deferred wgrad."""
    queue().append((token, record, compiled))


def drain() -> list:
    """The queued entries, the queue left empty."""
    entries = queue()
    taken = entries[:]
    entries.clear()
    return taken
