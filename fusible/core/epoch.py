"""A global counter of the changes that cached layouts and plans depend on.

It moves when a module that some layout has been built from changes: an op's
configuration (a new value for an attribute other than ``training``), a
Sequential's structure, parameters replaced by ``.to()`` and friends; and when
the set of registered fusions changes. Cached layouts and plans compare it
before use, and compiled models guard on it. Changes to modules no layout has
seen yet (a model being built) do not move it.
"""

_value = 0
MISSING = object()  # an attribute that was not set before


def bump() -> None:
    """Invalidate every cached layout and plan."""
    global _value
    _value += 1


def current() -> int:
    """The current epoch."""
    return _value


def mark_planned(module) -> None:
    """Record that a layout was built from ``module``: its changes matter from now on."""
    module.__dict__["_fusible_planned"] = True


def bump_if_planned(module) -> None:
    """Move the epoch if a layout has been built from ``module``."""
    if module.__dict__.get("_fusible_planned"):
        bump()


def changed(old, new) -> bool:
    """Whether an attribute write changes the value (tensors and objects: by identity)."""
    if old is new:
        return False
    if type(old) is type(new) and isinstance(new, (bool, int, float, str, tuple, type(None))):
        return old != new
    return True
