"""The registry of fusions: built-ins and third-party plugins, loaded the same way.

Fusions are advertised in the entry-point group ``fusible.fusions``: a class, or a module
whose classes call :func:`register_fusion` when imported. fusible's own, the built-ins
(``fusible.fusions``), are entry points of its distribution (``pyproject.toml``), like any
plugin's. All are loaded at the first planning (or the first registration), sorted by
entry-point name; classes that user code registers come after. Among accepted matches of
equal length the planner prefers the higher ``priority``, then the fusion registered
first: priority is explicit, never an accident of import order.
"""

from __future__ import annotations

import importlib.metadata
import inspect

import attrs

from fusible.core import epoch
from fusible.core.plugins import EntryPointGroup
from fusible.core.fused import FusedOperation
from fusible.core.pattern import Pattern
from fusible.core.stage import check_stage_class

ENTRY_POINT_GROUP = "fusible.fusions"
_DIRECTIONS = ("forward", "backward", "both")
_fusions: list = []


def register_fusion(cls: type) -> type:
    """Class decorator that makes a :class:`~fusible.FusedOperation` available to the planner.

    Parameters
    ----------
    cls : type
        A subclass of ``FusedOperation`` with ``direction``, ``pattern``, the args
        class of its direction and the matching compute hooks.

    Returns
    -------
    type
        ``cls`` itself, so that it can be used as a decorator.

    Raises
    ------
    TypeError, ValueError
        If the class is not a valid fusion; the message names the class and what is
        wrong.
    """
    validate_fusion(cls)
    load_plugins()
    if cls in _fusions:
        return cls
    clash = next((f for f in _fusions if f.__name__ == cls.__name__), None)
    if clash is not None:
        raise ValueError(f"fusion name {cls.__name__!r} is taken by {clash.__module__}."
                         f"{clash.__qualname__}; fusion class names must be unique")
    _fusions.append(cls)
    epoch.bump()
    return cls


def unregister_fusion(cls: type) -> None:
    """Remove a fusion from the planner (mostly for tests and experiments)."""
    _fusions.remove(cls)
    epoch.bump()


def registered_fusions(direction: str | None = None) -> tuple:
    """Registered fusions in planning priority order (priority, then registration),
    optionally of one direction."""
    load_plugins()
    order = sorted(range(len(_fusions)), key=lambda i: (-_fusions[i].priority, i))
    return tuple(_fusions[i] for i in order if direction in (None, _fusions[i].direction))


def load_plugins() -> None:
    """Load the fusions of the entry-point group ``fusible.fusions`` (once), fusible's own
    built-ins among them.

    A plugin that fails to load raises at every planning until it loads: nothing is
    skipped silently. So does a fusible that is not installed (its built-ins are entry
    points of its distribution).
    """
    _PLUGINS.load()


def _require_installed() -> None:
    try:
        importlib.metadata.distribution("fusible")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("fusible is imported from a source tree that is not installed: its "
                           "built-in fusions are entry points of the installed distribution "
                           "(run `pip install -e .` in the checkout)") from None


def validate_fusion(cls) -> None:
    """Raise TypeError or ValueError naming ``cls`` if it is not a valid fusion."""
    name = getattr(cls, "__name__", repr(cls))
    if not (inspect.isclass(cls) and issubclass(cls, FusedOperation)):
        raise TypeError(f"register_fusion needs a subclass of fusible.FusedOperation, got {cls!r}")
    if cls.direction not in _DIRECTIONS:
        raise ValueError(f"fusion {name}: direction must be 'forward', 'backward' or 'both' "
                         f"(a joint fusion), got {cls.direction!r}")
    if not isinstance(cls.pattern, Pattern):
        raise TypeError(f"fusion {name}: pattern must be a fusible.Pattern, got {cls.pattern!r}")
    if not isinstance(cls.priority, int):
        raise TypeError(f"fusion {name}: priority must be an int, got {cls.priority!r}")
    check_stage_class(cls, "fusion", FusedOperation, cls.directions())
    if cls.direction == "both" and not (inspect.isclass(cls.saved_type)
                                        and attrs.has(cls.saved_type)):
        raise TypeError(f"joint fusion {name} must set saved_type to the attrs class of the "
                        f"record its forward saves, got {cls.saved_type!r}")


# Loaded at the first planning or registration; its built-ins need the installed
# distribution (a source tree on the path alone says so).
_PLUGINS = EntryPointGroup(ENTRY_POINT_GROUP, "fusion", register_fusion,
                           before=_require_installed)
_state = _PLUGINS.state
