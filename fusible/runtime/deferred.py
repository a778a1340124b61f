"""The queue of deferred weight gradients (a split backward's wgrad lane).

A dgrad stage appends one entry per call: the token of its
:class:`~fusible.planning.features.split_backward.WgradTarget`, the args record its wgrad reads (the
saved input, ``dy`` as the dgrad used it: under FP8 its E5M2 copies) and whether it ran
in a compiled graph (then the wgrad runs through its custom op too). The compiled path
appends from inside the dgrad stage's custom op, so the record never crosses the graph.

One queue per process, not per thread: autograd runs a CUDA backward on a worker thread
of its own, and the entries it queues there are taken by the thread that called the
backward.
"""

from __future__ import annotations

import threading
import weakref

_entries: list = []
_lock = threading.Lock()
_taken: "weakref.WeakSet" = weakref.WeakSet()  # sets of entries handed out, not yet run


def queue() -> list:
    """A copy of the entries ``(target token, record, compiled)``, oldest first."""
    with _lock:
        return _entries[:]


def defer(token: int, record, compiled: bool) -> None:
    """Queue one deferred wgrad."""
    with _lock:
        _entries.append((token, record, compiled))


def drain() -> list:
    """The queued entries, the queue left empty."""
    with _lock:
        taken = _entries[:]
        _entries.clear()
    return taken


def hand_out(taken) -> None:
    """Note a set of entries taken from the queue and not yet run (held weakly)."""
    _taken.add(taken)


def handed_back(taken) -> None:
    """Note that a set of taken entries has run."""
    _taken.discard(taken)


def taken() -> list:
    """The sets of entries taken and not yet run."""
    return list(_taken)


def waiting() -> bool:
    """Whether any wgrad waits, queued or taken (cheap: read on every eager forward)."""
    return bool(_entries) or bool(_taken)


def forget() -> None:
    """Drop every entry, queued or taken (a test's leftovers)."""
    drain()
    _taken.clear()
