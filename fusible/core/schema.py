"""How argument values cross a ``torch.library`` custom-op boundary.

A stage's arguments are an attrs record; each field's annotation maps to one or more
schema arguments through a :class:`SchemaType`. Tensors, optional tensors, lists,
Python scalars, dtypes and enums are built in; nested attrs records flatten field by
field; other types (quantized tensors, FP8 formats, process groups) are taught by the
layer that defines them with :func:`register_schema_type`.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, Callable, Optional

import attrs
import torch


@attrs.frozen
class SchemaType:
    """How one field type crosses a custom-op boundary.

    Attributes
    ----------
    parts : tuple of str
        The schema types of the arguments one value becomes, e.g. ``("Tensor?",)``.
    flatten : callable
        ``value -> list`` of ``len(parts)`` values.
    unflatten : callable
        ``list -> value``, the inverse.
    record_type : type or None
        The attrs class, for a nested record.
    states : tuple of int
        The parts (``"Tensor?"``) that are state the op updates: a custom op may not
        write into its arguments, so its kernel updates a copy and returns it, and the
        caller writes that back (``fusible.runtime.custom_ops``).
    """

    parts: tuple
    flatten: Callable
    unflatten: Callable
    record_type: Optional[type] = None
    states: tuple = ()


_ADAPTERS: dict = {}
_SCALARS = {torch.Tensor: "Tensor", int: "SymInt", float: "float", bool: "bool", str: "str",
            torch.dtype: "ScalarType"}
_LISTS = {torch.Tensor: "Tensor[]", int: "SymInt[]", float: "float[]", bool: "bool[]"}
_RECORDS: dict = {}  # attrs class -> its fields' (name, SchemaType)


def register_schema_type(pytype: Any, schema_type: SchemaType) -> None:
    """Teach the schema derivation a new field annotation ``pytype``.

    Raises ValueError if ``pytype`` is taken by another schema type (rules are data:
    two layers must not silently disagree on how a type crosses).
    """
    if not isinstance(schema_type, SchemaType):
        raise TypeError(f"register_schema_type({pytype!r}, ...) needs a SchemaType, got "
                        f"{schema_type!r}")
    old = _ADAPTERS.get(pytype)
    if old is not None and old != schema_type:
        raise ValueError(f"{pytype!r} already crosses custom ops as {old.parts}")
    _ADAPTERS[pytype] = schema_type


def _TAKE(vals):
    return vals[0]


def _single(part: str) -> SchemaType:
    return SchemaType((part,), lambda v: [v], _TAKE)


def schema_type(tp) -> SchemaType:
    """The :class:`SchemaType` of a field annotation, or TypeError naming it."""
    if tp in _ADAPTERS:
        return _ADAPTERS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        if inner in _SCALARS:
            return _single(_SCALARS[inner] + "?")
    elif origin in (list, tuple) and args:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"fixed-length tuple {tp!r}; use tuple[X, ...] or list[X]")
        elem, convert = args[0], tuple if origin is tuple else list
        part = _LISTS.get(elem) or ("Tensor?[]" if elem == typing.Optional[torch.Tensor] else None)
        if part is not None:
            return SchemaType((part,), lambda v: [list(v)], lambda vals: convert(vals[0]))
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        return SchemaType(("str",), lambda v: [v.name], lambda vals: tp[vals[0]])
    elif isinstance(tp, type) and attrs.has(tp):
        return _record_type(tp)
    elif tp in _SCALARS:
        return _single(_SCALARS[tp])
    raise TypeError(f"no custom-op schema type for {tp!r}")


def record_fields(record_type) -> tuple:
    """``((field name, SchemaType), ...)`` of an attrs record, nested records included."""
    if record_type not in _RECORDS:
        if not (isinstance(record_type, type) and attrs.has(record_type)):
            raise TypeError(f"an args type must be an attrs class, got {record_type!r}")
        attrs.resolve_types(record_type)
        fields = []
        for field in attrs.fields(record_type):
            if not field.init:  # derived in the record's own __attrs_post_init__
                continue
            try:
                fields.append((field.name, schema_type(field.type)))
            except TypeError as error:
                raise TypeError(f"field {record_type.__name__}.{field.name}: {error}") from None
        _RECORDS[record_type] = tuple(fields)
    return _RECORDS[record_type]


def flatten_record(fields: tuple, record) -> list:
    """The schema argument values of ``record`` (see :func:`record_fields`)."""
    return [v for name, st in fields for v in st.flatten(getattr(record, name))]


def unflatten_record(record_type, fields: tuple, values) -> object:
    """Rebuild a ``record_type`` from its schema argument values (this runs in every
    custom-op call: a plain value is taken as it is, other fields rebuilt from their
    slice; positionally, unless the record has keyword-only fields)."""
    steps, names = _STEPS.get(record_type) or _unflatten_steps(record_type, fields)
    values = [values[i] if rebuild is None else rebuild(values[i:j]) for i, j, rebuild in steps]
    return record_type(*values) if names is None else record_type(**dict(zip(names, values)))


_STEPS: dict = {}  # record type -> (((start, stop, rebuild or None), ...), init names or None)


def _unflatten_steps(record_type, fields: tuple) -> tuple:
    steps, pos = [], 0
    for _, st in fields:
        n = len(st.parts)
        steps.append((pos, pos + n, None if st.unflatten is _TAKE else st.unflatten))
        pos += n
    init = [f for f in attrs.fields(record_type) if f.init]
    names = None
    if any(f.kw_only for f in init):  # then every field by its __init__ name
        names = tuple(getattr(f, "alias", None) or f.name.lstrip("_") for f in init)
    _STEPS[record_type] = (tuple(steps), names)
    return _STEPS[record_type]


def record_builder(record_type, sources: list) -> Callable:
    """A function ``flat -> record`` generated once, for calls whose constant values
    are known: ``sources[i]`` is where the record's value ``i`` comes from, ``("arg", k)``
    (``flat[k]``) or ``("const", value)``. Fields made only of constants are built once
    and shared when immutable (hashable); the rest is one constructor expression."""
    namespace: dict = {}
    expr = _builder_expr(record_type, sources, namespace)
    exec(f"def build(f):\n    return {expr}\n", namespace)  # noqa: S102 (our own source)
    return namespace["build"]


def _bind(namespace: dict, value) -> str:
    name = f"c{len(namespace)}"
    namespace[name] = value
    return name


def _builder_expr(record_type, sources: list, namespace: dict) -> str:
    fields = record_fields(record_type)
    _, names = _STEPS.get(record_type) or _unflatten_steps(record_type, fields)
    args, pos = [], 0
    for _, st in fields:
        srcs = sources[pos:pos + len(st.parts)]
        pos += len(st.parts)
        if all(kind == "const" for kind, _ in srcs):
            value = st.unflatten([v for _, v in srcs])
            try:
                hash(value)
            except TypeError:  # mutable: rebuilt per call
                pass
            else:
                args.append(_bind(namespace, value))
                continue
        if st.record_type is not None:
            args.append(_builder_expr(st.record_type, srcs, namespace))
            continue
        items = [f"f[{v}]" if kind == "arg" else _bind(namespace, v) for kind, v in srcs]
        if st.unflatten is _TAKE:
            args.append(items[0])
        else:
            args.append(f"{_bind(namespace, st.unflatten)}([{', '.join(items)}])")
    if names is not None:
        args = [f"{n}={a}" for n, a in zip(names, args)]
    return f"{_bind(namespace, record_type)}({', '.join(args)})"


def state_parts(fields: tuple) -> tuple:
    """The positions of the state parts (:attr:`SchemaType.states`) among the flattened
    parts of ``fields`` (``(name, SchemaType)`` pairs)."""
    found, pos = [], 0
    for _, st in fields:
        found += [pos + i for i in st.states]
        pos += len(st.parts)
    return tuple(found)


def _record_type(record_type) -> SchemaType:
    fields = record_fields(record_type)
    return SchemaType(tuple(p for _, st in fields for p in st.parts),
                      lambda v: flatten_record(fields, v),
                      lambda vals: unflatten_record(record_type, fields, vals), record_type,
                      states=state_parts(fields))
