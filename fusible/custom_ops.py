"""Custom ops derived from the ops' attrs argument classes: the compiled path's stages.

For each op or fusion class and direction, ``fusible::{Name}_{fwd|bwd}`` takes
the fields of its ``fwd_args_type`` / ``bwd_args_type`` (each field becoming one
or more schema arguments) plus a provenance string, and returns ``Tensor[]``.
Its real kernel is the class's compute method bound with ``in_custom_op=True``;
its fake kernel is the same method run on fake tensors (a class may provide
``forward_fake`` / ``backward_fake`` instead). Registration is lazy: the first
compiled run of a class registers it, built-in and user-defined alike.

Results cross the boundary flattened: forward ``[output, *extra_outputs,
*aux]``; backward ``[grad_input, *grad_params, *grad_extra_inputs]`` with an
empty placeholder where a gradient is not needed (schemas have no optional
returns); the caller restores the structure from the stage's static counts.
"""

from __future__ import annotations

import enum
import functools
import re
import types
import typing
from typing import Any, Callable

import attrs
import torch

from fusible import distributed
from fusible.ops.base import BackwardResult, ForwardResult
from fusible.quantization import boundary
from fusible.quantization.flow import to_fp8_format

_LIB = torch.library.Library("fusible", "FRAGMENT")
_OPS: dict = {}      # (class, direction) -> StageOp
_REASONS: dict = {}  # (class, direction) -> why it cannot be registered
recorder: list | None = None  # when a list, calls append (overload, flat args): for opcheck


@attrs.frozen
class SchemaType:
    """How one field type crosses a custom-op boundary.

    ``parts`` are the schema types of the arguments one value becomes;
    ``flatten(value)`` returns that many values, ``unflatten(values)`` rebuilds it.
    """

    parts: tuple
    flatten: Callable
    unflatten: Callable


_ADAPTERS: dict = {}


def register_schema_type(pytype, schema_type: SchemaType) -> None:
    """Teach the schema derivation a new field type (quantized tensors, process groups)."""
    _ADAPTERS[pytype] = schema_type


boundary.register_schema_types(register_schema_type, SchemaType)
distributed.register_schema_types(register_schema_type, SchemaType)


def _single(part: str, convert=None) -> SchemaType:
    return SchemaType((part,), lambda v: [v], (lambda vals: convert(vals[0])) if convert
                      else (lambda vals: vals[0]))


_SCALARS = {torch.Tensor: "Tensor", int: "SymInt", float: "float", bool: "bool", str: "str",
            torch.dtype: "ScalarType"}
_LISTS = {torch.Tensor: "Tensor[]", int: "SymInt[]", float: "float[]", bool: "bool[]"}


def schema_type(tp) -> SchemaType:
    """The :class:`SchemaType` of a field annotation, or TypeError."""
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
    elif tp in _SCALARS:
        return _single(_SCALARS[tp])
    raise TypeError(f"no custom-op schema type for {tp!r}")


@attrs.frozen
class StageOp:
    """A registered custom op of one class and direction."""

    name: str
    overload: Any
    fields: tuple        # (attrs field name, SchemaType)

    def flatten_args(self, args) -> list:
        return [v for name, st in self.fields for v in st.flatten(getattr(args, name))]


def _fields(args_type) -> tuple:
    if not (isinstance(args_type, type) and attrs.has(args_type)):
        raise TypeError(f"its args type must be an attrs class, got {args_type!r}")
    attrs.resolve_types(args_type)
    out = []
    for field in attrs.fields(args_type):
        try:
            out.append((field.name, schema_type(field.type)))
        except TypeError as error:
            raise TypeError(f"field {args_type.__name__}.{field.name}: {error}") from None
    return tuple(out)


_BASES: dict = {}    # class -> its op base name, chosen once for both directions


def _op_name(cls, direction: str) -> str:
    """``{Class}_fwd|_bwd``; a class whose name another class took gets a qualified name."""
    if cls not in _BASES:
        base = cls.__name__
        if base in _BASES.values():
            base = re.sub(r"\W", "_", f"{cls.__module__}.{cls.__qualname__}")
            while base in _BASES.values():
                base += "_"
        _BASES[cls] = base
    return f"{_BASES[cls]}_{'fwd' if direction == 'forward' else 'bwd'}"


def _unflatten_args(args_type, fields, values):
    kwargs, pos = {}, 0
    for name, st in fields:
        n = len(st.parts)
        kwargs[name] = st.unflatten(list(values[pos:pos + n]))
        pos += n
    return args_type(**kwargs)


def _flatten_result(result, direction: str, values, fp8: bool, fp8_out) -> list:
    if direction == "forward":
        if not isinstance(result, ForwardResult):
            raise TypeError(f"forward_compute must return a ForwardResult, got {result!r}")
        output = to_fp8_format(result.output, fp8_out)
        tensors = [output, *result.extra_outputs, *result.aux]
    else:
        if not isinstance(result, BackwardResult):
            raise TypeError(f"backward_compute must return a BackwardResult, got {result!r}")
        grad = result.grad_input
        grad = grad if grad is None else to_fp8_format(grad, fp8_out)
        tensors = [grad, *result.grad_params, *result.grad_extra_inputs]
    like = next(v for v in values if isinstance(v, torch.Tensor))
    return boundary.encode_results(tensors, fp8, like)


def _kernel(cls, direction: str, args_type, fields, compute):
    bound = functools.partial(compute, in_custom_op=True)
    own_cast = cls.quantizes_own_output

    def kernel(*values):
        # After the args: the format to hand FP8 on in, the FP8-results flag, the provenance.
        args = _unflatten_args(args_type, fields, values[:-4])
        out_dtype, out_columnwise, fp8 = values[-4:-1]
        fp8_out = None if out_dtype is None else (out_dtype, out_columnwise)
        result = bound(args, fp8_out=fp8_out) if own_cast else bound(args)
        return _flatten_result(result, direction, values, fp8, fp8_out)

    return kernel


def _register(cls, direction: str) -> StageOp:
    args_type = cls.fwd_args_type if direction == "forward" else cls.bwd_args_type
    fields = _fields(args_type)
    name = _op_name(cls, direction)
    params = [f"{part} {fname}" if len(st.parts) == 1 else f"{part} {fname}_{i}"
              for fname, st in fields for i, part in enumerate(st.parts)]
    tail = ["ScalarType? fp8_out_dtype", "bool fp8_out_columnwise", "bool fp8", "str provenance"]
    _LIB.define(f"{name}({', '.join(params + tail)}) -> Tensor[]")
    compute = getattr(cls, f"{direction}_compute")
    fake = getattr(cls, f"{direction}_fake", None) or compute
    _LIB.impl(name, _kernel(cls, direction, args_type, fields, compute),
              "CompositeExplicitAutograd")
    torch.library.register_fake(f"fusible::{name}",
                                _kernel(cls, direction, args_type, fields, fake), lib=_LIB)
    return StageOp(name, getattr(torch.ops.fusible, name).default, fields)


def stage_op(cls, direction: str) -> StageOp:
    """The custom op of ``cls`` for ``direction``, registered on first use.

    Raises TypeError naming the class when its args cannot become a schema.
    """
    reason = unsupported_reason(cls, direction)
    if reason is not None:
        raise TypeError(reason)
    return _OPS[(cls, direction)]


def unsupported_reason(cls, direction: str) -> str | None:
    """Why ``cls`` cannot run compiled in ``direction`` (registering it first), or None."""
    key = (cls, direction)
    if key not in _OPS and key not in _REASONS:
        try:
            _OPS[key] = _register(cls, direction)
        except (TypeError, RuntimeError) as error:  # no schema type; a schema torch rejects
            _REASONS[key] = f"{cls.__name__} ({direction}): {error}"
    return _REASONS.get(key)


def _call(stage, direction: str, args, provenance: str, fp8_dtype):
    op = stage_op(type(stage.op), direction)
    out_dtype, out_columnwise = stage.fp8_out or (None, False)
    flat = op.flatten_args(args) + [out_dtype, out_columnwise, fp8_dtype is not None,
                                    provenance]
    if recorder is not None:
        recorder.append((op.overload, tuple(flat)))
    out = op.overload(*flat)
    return op, boundary.decode_results(out, fp8_dtype is not None, fp8_dtype)


def call_forward(stage, args, provenance: str, fp8_dtype=None) -> ForwardResult:
    """Run a forward stage through its custom op.

    ``fp8_dtype``: under an FP8 recipe, the pipeline's dtype (that of the
    Float8Tensors among the results); None otherwise.
    """
    _, out = _call(stage, "forward", args, provenance, fp8_dtype)
    k = stage.num_extra_out
    return ForwardResult(out[0], tuple(out[1:1 + k]), tuple(out[1 + k:]))


def call_backward(stage, args, provenance: str, fp8_dtype=None) -> BackwardResult:
    """Run a backward stage through its custom op; placeholders become None."""
    op, out = _call(stage, "backward", args, provenance, fp8_dtype)
    input_needed, params_needed, extras_needed = stage.grad_mask
    expected = 1 + len(params_needed) + len(extras_needed)
    if len(out) != expected:
        raise RuntimeError(f"{op.name} returned {len(out)} gradients, expected {expected}")
    np_ = len(params_needed)
    return BackwardResult(out[0] if input_needed else None,
                          tuple(g if n else None for g, n in zip(out[1:1 + np_], params_needed)),
                          tuple(g if n else None for g, n in zip(out[1 + np_:], extras_needed)))
