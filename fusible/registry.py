"""The registry of fusions: built-ins, entry-point plugins and user classes alike.

Registration order is planning priority among matches of equal length, so the
order is deterministic: the built-ins (``fusions/``, imported when ``fusible``
is), then classes registered by user code as it runs, and entry points of the
group ``fusible.fusions`` loaded at the first planning, sorted by name.
"""

from __future__ import annotations

import importlib.metadata
import inspect

import attrs

from fusible import _epoch
from fusible.ops.base import FusedOperation
from fusible.pattern import Pattern

ENTRY_POINT_GROUP = "fusible.fusions"
_DIRECTIONS = ("forward", "backward")
_fusions: list[type[FusedOperation]] = []
_entry_points_loaded = False


def register_fusion(cls: type) -> type:
    """Class decorator that makes a :class:`~fusible.FusedOperation` available to the planner.

    Parameters
    ----------
    cls : type
        A subclass of ``FusedOperation`` with ``direction``, ``pattern``, the
        args class of its direction and the matching compute methods.

    Returns
    -------
    type
        ``cls`` itself, so that it can be used as a decorator.

    Raises
    ------
    TypeError, ValueError
        If the class is not a valid fusion; the message names the class and
        what is wrong.
    """
    _validate(cls)
    if cls in _fusions:
        return cls
    clash = next((f for f in _fusions if f.__name__ == cls.__name__), None)
    if clash is not None:
        raise ValueError(f"fusion name {cls.__name__!r} is taken by {clash.__module__}."
                         f"{clash.__qualname__}; fusion class names must be unique")
    _fusions.append(cls)
    _epoch.bump()
    return cls


def unregister_fusion(cls: type) -> None:
    """Remove a fusion from the planner (mostly for tests and experiments)."""
    _fusions.remove(cls)
    _epoch.bump()


def registered_fusions(direction: str | None = None) -> tuple[type[FusedOperation], ...]:
    """Registered fusions in priority order, optionally of one direction."""
    load_entry_points()
    return tuple(f for f in _fusions if direction in (None, f.direction))


def load_entry_points() -> None:
    """Import and register the fusions advertised under the ``fusible.fusions`` group (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                     key=lambda e: e.name):
        try:
            loaded = ep.load()
            # An entry point may name a fusion class or a module whose classes
            # register themselves on import.
            if inspect.isclass(loaded):
                register_fusion(loaded)
        except Exception as error:  # every later planning raises too: nothing is skipped
            raise RuntimeError(f"fusion plugin {ep.name!r} ({ep.value}) of entry-point group "
                               f"{ENTRY_POINT_GROUP!r} failed to load: {error}") from error
    _entry_points_loaded = True


def _validate(cls) -> None:
    name = getattr(cls, "__name__", repr(cls))
    if not (inspect.isclass(cls) and issubclass(cls, FusedOperation)):
        raise TypeError(f"register_fusion needs a subclass of fusible.FusedOperation, got {cls!r}")
    if cls.direction not in _DIRECTIONS:
        raise ValueError(f"fusion {name}: direction must be 'forward' or 'backward', "
                         f"got {cls.direction!r}")
    if not isinstance(cls.pattern, Pattern):
        raise TypeError(f"fusion {name}: pattern must be a fusible.pattern.Pattern, "
                        f"got {cls.pattern!r}")
    if cls.direction == "forward":
        needed = ("fwd_args_type", "forward_args", "forward_compute", "save_for_backward")
    else:
        needed = ("bwd_args_type", "backward_args", "backward_compute")
    missing = [m for m in needed if not _defined_below(cls, m)]
    if missing:
        raise TypeError(f"fusion {name} ({cls.direction}) must define {', '.join(missing)}")
    args_type = cls.fwd_args_type if cls.direction == "forward" else cls.bwd_args_type
    if not (inspect.isclass(args_type) and attrs.has(args_type)):
        raise TypeError(f"fusion {name}: its args type must be an attrs class, got {args_type!r}")
    compute = cls.forward_compute if cls.direction == "forward" else cls.backward_compute
    if not inspect.ismethod(compute):
        raise TypeError(f"fusion {name}: {compute.__name__} must be a classmethod")


def _defined_below(cls, attr: str) -> bool:
    """Whether ``attr`` is set on a class between ``cls`` and the FusedOperation base."""
    for klass in cls.__mro__:
        if klass is FusedOperation:
            return False
        if attr in vars(klass) and vars(klass)[attr] is not None:
            return True
    return False
