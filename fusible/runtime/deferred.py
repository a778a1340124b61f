"""The queue of deferred weight gradients (a split backward's wgrad lane), per thread.

A dgrad stage appends one entry per call: the token of its
:class:`~fusible.planning.features.split_backward.WgradTarget`, the args record its wgrad
reads (the saved input, ``dy`` as the dgrad used it: under FP8 its E5M2 copies), whether
it ran in a compiled graph (then the wgrad runs through its custom op too) and its owner:
the thread whose forward made it. The compiled path appends from inside the dgrad stage's
custom op, so the record never crosses the graph, and without an owner (a compiled
graph's backward does not know its forward's thread): such entries are every thread's.

Entries belong to the thread of their forward, like ``fusible.autocast``'s state, though
autograd may run the backward on a worker thread of its own (a CUDA backward does): a
thread sees, takes and is refused for its own entries only (and the ownerless ones).
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

_entries: list = []  # (target token, record, compiled, owner thread or None)
_lock = threading.Lock()
_taken: "weakref.WeakSet" = weakref.WeakSet()  # sets of entries handed out, not yet run


def _mine(owner: Optional[int], thread: int) -> bool:
    return owner is None or owner == thread


def queue(thread: Optional[int] = None) -> list:
    """A copy of the entries ``(target token, record, compiled, owner)``, oldest first:
    every thread's, or ``thread``'s (and the ownerless ones)."""
    with _lock:
        return [e for e in _entries if thread is None or _mine(e[3], thread)]


def defer(token: int, record, compiled: bool, owner: Optional[int] = None) -> None:
    """Queue one deferred wgrad of the thread ``owner`` (None: every thread's)."""
    with _lock:
        _entries.append((token, record, compiled, owner))


def drain(thread: int) -> list:
    """``thread``'s queued entries (and the ownerless ones), taken out of the queue."""
    with _lock:
        taken = [e for e in _entries if _mine(e[3], thread)]
        _entries[:] = [e for e in _entries if not _mine(e[3], thread)]
    return taken


def hand_out(taken) -> None:
    """Note a set of entries taken from the queue and not yet run (held weakly; its
    ``owner`` is the thread that took it)."""
    _taken.add(taken)


def handed_back(taken) -> None:
    """Note that a set of taken entries has run."""
    _taken.discard(taken)


def taken(thread: Optional[int] = None) -> list:
    """The sets of entries taken and not yet run: all, or those ``thread`` took."""
    return [t for t in list(_taken) if thread is None or t.owner == thread]


def waiting(thread: int) -> bool:
    """Whether a wgrad of ``thread`` waits, queued or taken (cheap when none does at
    all: read on every eager forward once a split plan exists)."""
    if not (_entries or _taken):
        return False
    return bool(queue(thread)) or bool(taken(thread))


def forget() -> None:
    """Drop every entry, queued or taken (a test's leftovers)."""
    with _lock:
        _entries.clear()
    _taken.clear()
