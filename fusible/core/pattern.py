"""The pattern DSL that fusions declare: rules as data.

A pattern is a sequence of elements matched against consecutive basic ops::

    Pattern(
        Op(BasicLinear, name="linear"),
        Op(Bias, name="bias", optional=True),
        Op(GELU, approximate="tanh", name="activation") | Op(ReLU, name="activation"),
    )

* ``Op(types, name=None, where=None, optional=False, **attributes)`` matches
  one op that is an instance of ``types`` whose attributes equal the given
  values and for which ``where`` (a :class:`Check`) holds.
* ``element.optional()`` (or ``Op(..., optional=True)``) matches the element
  or nothing; longer matches are tried first.
* ``a | b`` (or ``AnyOf(a, b)``) matches either alternative.

Type mismatches end a match; attribute and ``where`` failures make it a *near
miss* whose reason the plan reports.
"""

from __future__ import annotations

from typing import Callable, Iterator

import attrs


@attrs.frozen
class Check:
    """A predicate on one op with a description used in refusal reasons."""

    fn: Callable
    description: str

    def __call__(self, op) -> bool:
        return bool(self.fn(op))


@attrs.frozen
class Match:
    """One way a pattern matched a run of ops.

    Attributes
    ----------
    ops : tuple
        The matched basic ops, in forward order.
    indices : tuple of int
        Their positions in the flattened pipeline.
    names : dict
        Element name -> matched op, or None for an absent optional element.
    failures : tuple of str
        Attribute or ``where`` checks that failed (empty for a real match).
    """

    ops: tuple
    indices: tuple
    names: dict = attrs.field(eq=False, hash=False)
    failures: tuple = ()

    def __getitem__(self, name: str):
        return self.names[name]

    def __len__(self) -> int:
        return len(self.ops)


class Element:
    """Base of pattern elements."""

    def names(self) -> set:
        raise NotImplementedError

    def match_at(self, ops: list, pos: int) -> Iterator[tuple[int, dict, tuple]]:
        """Yield (ops consumed, names, failures) for each way to match at ``pos``."""
        raise NotImplementedError

    def __or__(self, other: "Element") -> "AnyOf":
        return AnyOf(self, other)

    def optional(self) -> "OptionalElement":
        """This element or nothing."""
        return OptionalElement(self)


class Op(Element):
    """Match one op by type, attribute values and an optional :class:`Check`."""

    def __init__(self, types: type | tuple[type, ...], *, name: str | None = None,
                 where: Check | None = None, optional: bool = False, **attributes):
        types = types if isinstance(types, tuple) else (types,)
        if not types or not all(isinstance(t, type) for t in types):
            raise TypeError(f"Op() needs operation classes, got {types!r}")
        if where is not None and not isinstance(where, Check):
            raise TypeError(f"Op(where=...) must be a fusible.Check, got {where!r}")
        self.types, self.name, self.where, self.attributes = types, name, where, attributes
        self.is_optional = optional

    def names(self) -> set:
        return {self.name} if self.name else set()

    def match_at(self, ops, pos):
        if pos < len(ops) and isinstance(ops[pos], self.types):
            op = ops[pos]
            failures = tuple(
                f"{type(op).__name__}.{attr}={getattr(op, attr, None)!r}, needs {value!r}"
                for attr, value in self.attributes.items() if getattr(op, attr, None) != value)
            if self.where is not None and not self.where(op):
                failures += (f"{type(op).__name__} fails: {self.where.description}",)
            yield 1, ({self.name: op} if self.name else {}), failures
        if self.is_optional:
            yield 0, ({self.name: None} if self.name else {}), ()

    def __repr__(self) -> str:
        kinds = "|".join(t.__name__ for t in self.types)
        extra = "".join(f", {k}={v!r}" for k, v in self.attributes.items())
        return f"Op({kinds}{extra}{', optional=True' if self.is_optional else ''})"


class OptionalElement(Element):
    """Match ``element`` or nothing (the longer match is tried first)."""

    def __init__(self, element: Element):
        if not isinstance(element, Element):
            raise TypeError(f"optional() needs a pattern element, got {element!r}")
        self.element = element

    def names(self) -> set:
        return self.element.names()

    def match_at(self, ops, pos):
        yield from self.element.match_at(ops, pos)
        yield 0, dict.fromkeys(self.element.names()), ()

    def __repr__(self) -> str:
        return f"{self.element!r}.optional()"


class AnyOf(Element):
    """Match any one of the alternatives, tried in order."""

    def __init__(self, *alternatives: Element):
        if len(alternatives) < 2 or not all(isinstance(a, Element) for a in alternatives):
            raise TypeError(f"AnyOf() needs two or more pattern elements, got {alternatives!r}")
        flat: list[Element] = []
        for alt in alternatives:
            flat.extend(alt.alternatives if isinstance(alt, AnyOf) else (alt,))
        self.alternatives: tuple[Element, ...] = tuple(flat)

    def names(self) -> set:
        return set().union(*(a.names() for a in self.alternatives))

    def match_at(self, ops, pos):
        all_names = self.names()
        for alt in self.alternatives:
            for n, names, failures in alt.match_at(ops, pos):
                yield n, {**dict.fromkeys(all_names), **names}, failures

    def __repr__(self) -> str:
        return " | ".join(repr(a) for a in self.alternatives)


class Pattern:
    """A sequence of elements matched against consecutive basic ops."""

    def __init__(self, *elements: Element):
        if not elements:
            raise ValueError("Pattern() needs at least one element")
        for e in elements:
            if not isinstance(e, Element):
                raise TypeError(f"Pattern elements must be Op, AnyOf or .optional() elements, "
                                f"got {e!r}")
        if all(isinstance(e, OptionalElement) or getattr(e, "is_optional", False)
               for e in elements):
            raise ValueError(f"Pattern{elements!r} has only optional elements; it could match "
                             f"nothing")
        self.elements = tuple(elements)

    def matches(self, ops: list, pos: int, reverse: bool = False) -> list[tuple[int, dict, tuple]]:
        """All (length, names, failures) matches starting at ``pos``, longest first.

        With ``reverse`` the ops list is in backward order and the pattern is
        matched from its last element.
        """
        elements = self.elements[::-1] if reverse else self.elements
        found = list(_match_sequence(elements, ops, pos))
        found.sort(key=lambda m: -m[0])  # stable: equal lengths keep declaration order
        return found

    def __repr__(self) -> str:
        return f"Pattern({', '.join(repr(e) for e in self.elements)})"


def _match_sequence(elements, ops, pos):
    if not elements:
        yield 0, {}, ()
        return
    head, rest = elements[0], elements[1:]
    for n, names, failures in head.match_at(ops, pos):
        for m, more_names, more_failures in _match_sequence(rest, ops, pos + n):
            yield n + m, {**names, **more_names}, failures + more_failures
