"""Argument checks for operation constructors and attributes: by type and by value, with
errors that name the operation and the argument.

An operation lists its checked attributes in ``attribute_checks`` (name -> check); the
check runs on every assignment, in the constructor and after it, so that a value set
later (``gelu.approximate = "bogus"``) is refused like one given at construction.
"""

from __future__ import annotations

import numbers
from typing import Callable, cast

import torch

Check = Callable[[str, object], object]  # (op name, value) -> the value to store


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def positive_int(name: str) -> Check:
    """An ``int`` (not a bool) greater than zero."""
    def check(op: str, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{op}: {name} must be an int, got {_describe(value)}")
        if value <= 0:
            raise ValueError(f"{op}: {name} must be positive, got {name}={value}")
        return int(value)
    return check


def integer(name: str) -> Check:
    """An ``int`` (not a bool), of any sign."""
    def check(op: str, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{op}: {name} must be an int, got {_describe(value)}")
        return int(value)
    return check


def optional(check: Check) -> Check:
    """``check``, or None."""
    def check_or_none(op: str, value):
        return None if value is None else check(op, value)
    return check_or_none


def boolean(name: str) -> Check:
    """A ``bool``."""
    def check(op: str, value):
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {_describe(value)}")
        return value
    return check


def real(name: str, *, minimum: float | None = None) -> Check:
    """A real number (not a bool), stored as a float, at least ``minimum`` if given."""
    def check(op: str, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{op}: {name} must be a real number, got {_describe(value)}")
        # cast: numbers.Real's stub declares only < and <= (every real type has >=)
        if minimum is not None and not cast(float, value) >= minimum:
            raise ValueError(f"{op}: {name} must be at least {minimum}, got {name}={value}")
        return float(value)
    return check


def positive_real(name: str) -> Check:
    """A real number (not a bool) greater than zero, stored as a float."""
    check_real = real(name)

    def check(op: str, value):
        value = check_real(op, value)
        if not value > 0:
            raise ValueError(f"{op}: {name} must be positive, got {name}={value}")
        return value
    return check


def name_string(name: str) -> Check:
    """A non-empty ``str``."""
    def check(op: str, value):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{op}: {name} must be a non-empty str, got {_describe(value)}")
        return value
    return check


def one_of(name: str, choices: tuple) -> Check:
    """One of ``choices``."""
    def check(op: str, value):
        if value not in choices:
            raise ValueError(f"{op}: {name} must be one of {choices}, got {value!r}")
        return value
    return check


def int_tuple(name: str, *, minimum: int = 1) -> Check:
    """An int or a sequence of ints (not bools, not a string), each at least ``minimum``;
    stored as a tuple."""
    def check(op: str, value):
        items = (value,) if isinstance(value, numbers.Integral) else value
        if isinstance(value, (str, bytes)) or not hasattr(items, "__iter__"):
            raise TypeError(f"{op}: {name} must be an int or a sequence of ints, got "
                            f"{_describe(value)}")
        items = tuple(items)
        if not items or any(isinstance(i, bool) or not isinstance(i, numbers.Integral)
                            for i in items):
            raise TypeError(f"{op}: {name} must be a non-empty sequence of ints, got "
                            f"{value!r}")
        if any(i < minimum for i in items):
            raise ValueError(f"{op}: {name} must hold ints of at least {minimum}, got "
                             f"{name}={value!r}")
        return tuple(int(i) for i in items)
    return check


def extra_tensor(op: str, value, what: str, kind: str, shape: tuple, dtype_ok: Callable,
                 device) -> None:
    """Raise TypeError naming ``op`` unless ``value`` is a tensor of ``shape`` whose dtype
    passes ``dtype_ok``, ValueError unless it is on ``device`` (an extra input such as the
    labels: ``what``; ``kind`` says what it must be, "an integer tensor")."""
    if not (isinstance(value, torch.Tensor) and dtype_ok(value.dtype)
            and tuple(value.shape) == tuple(shape)):
        got = (f"{value.dtype} of shape {tuple(value.shape)}"
               if isinstance(value, torch.Tensor) else type(value).__name__)
        raise TypeError(f"{op} takes {what} as {kind} of shape {tuple(shape)}, got {got}")
    if value.device != device:
        raise ValueError(f"{op}: {what} are on {value.device}, the input on {device}")
