"""A global counter of configuration changes that cached plans depend on.

Any change to a fusible op's attributes, a Sequential's structure or the set of
registered fusions bumps it; cached layouts and plans compare it before use.
"""

_value = 0


def bump() -> None:
    """Invalidate every cached plan and layout."""
    global _value
    _value += 1


def current() -> int:
    """The current epoch."""
    return _value
