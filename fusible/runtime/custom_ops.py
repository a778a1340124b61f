"""Custom ops derived from the stages' attrs argument records: the compiled path's stages.

For each op or fusion class and direction, ``fusible::{Name}_{fwd|bwd}`` takes the
fields of its ``fwd_args_type`` / ``bwd_args_type`` (each field becoming one or more
values, ``fusible.core.schema``), then the format to hand the result on in, whether
results may be quantized, and a provenance string; it returns ``Tensor[]``. Only the
tensors and integers (which may be symbolic) are schema arguments; every other value
is a constant of the compiled graph and travels in one JSON string, the last argument,
decoded once per distinct string. The dispatcher converts each argument twice per
call (about 0.4 us each on a CPU host): a linear stage had 21, it now has 6.
Its real kernel is the class's compute method bound with ``in_custom_op=True``; its
fake kernel is the same method run on fake tensors (a class may provide
``forward_fake`` / ``backward_fake`` instead). Registration is lazy: the first plan
of a class registers it, built-in and user-defined alike.

The boundary does for every op what a custom op needs: a result that aliases an
argument is copied (so no compute method copies by hand), and a result the next stage
wants quantized is quantized inside the op.

Results cross flattened: forward ``[output, *extra_outputs, *aux]``; backward
``[grad_input, *grad_params, *grad_extra_inputs]`` with an empty placeholder where a
gradient is not needed (schemas have no optional returns); the caller restores the
structure from the stage's static counts.

State a stage updates (a stateful format's, ``SchemaType.states``: delayed scaling's amax
histories) crosses as a tensor argument, but a custom op may not write into its
arguments (PyTorch's functionalization does not take mutable ops returning lists): the
kernel updates a copy, returns it after the results, and the caller writes it back
into the state, an in-place copy that the compiled graph keeps as a mutation of its
input. Eagerly the compute updates the state itself.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional

import attrs
import torch

from fusible.core.inductor_fallbacks import ensure_fallback
from fusible.core.results import BackwardResult, ForwardResult
from fusible.core.schema import (flatten_record, record_builder, record_fields, schema_type,
                                 state_parts)
from fusible.kernels.fp8_cast import fresh_zeros_inside
from fusible.quantization.format import Float8Format, to_format
from fusible.quantization.tensor.boundary import decode_results, encode_results
from fusible.runtime import deferred, recompute

_LIB = torch.library.Library("fusible", "FRAGMENT")
_OPS: dict = {}      # (class, direction) -> StageOp
_BY_NAME: dict = {}  # op name -> StageOp
_REASONS: dict = {}  # (class, direction) -> why it cannot be registered
recorder: list | None = None  # when a list, calls append (overload, flat args): for opcheck
_FORMAT = schema_type(Optional[Float8Format])  # how the output format crosses
_TAIL = (*(("output_format" if len(_FORMAT.parts) == 1 else f"output_format_{i}", part)
           for i, part in enumerate(_FORMAT.parts)),
         ("quantized_results", "bool"), ("provenance", "str"))
_DECODED: dict = {}   # (op name, static values' JSON string) -> every value of a call
_PREPARED: dict = {}  # (op name, that string) -> StageOp.prepared
_DYNAMIC = {"Tensor", "Tensor?", "Tensor[]", "Tensor?[]", "SymInt", "SymInt?", "SymInt[]"}
# a tensor's StorageImpl, as an int (no Python object)
_storage_id = torch._C._storage_id  # type: ignore[attr-defined]  # not in torch's stub
_UNSET = object()


@attrs.frozen
class StageOp:
    """A registered custom op of one class and direction.

    ``parts`` are ``(name, schema type)`` of every value a call carries: the args
    record's, then the tail (output format, quantized results, provenance); ``dynamic``
    the positions among them that are schema arguments, ``static`` the rest, which
    travel as one JSON string; ``states`` the schema arguments that are state the kernel
    updates (a copy of), ``tail_state`` the output format's among them.
    """

    name: str
    args_type: type
    fields: tuple        # (attrs field name, SchemaType)
    parts: tuple
    dynamic: tuple
    static: tuple
    states: tuple = ()
    tail_state: int = -1
    overload: Any = None

    def flatten_call(self, args, output_format, quantized: bool, provenance: str) -> list:
        """The schema arguments of a call: the dynamic values, then the static ones'
        JSON string."""
        values = (flatten_record(self.fields, args) + _FORMAT.flatten(output_format)
                  + [quantized, provenance])
        return [values[i] for i in self.dynamic] + [self._encode(values)]

    def expand(self, flat) -> list:
        """Every value of a call, in ``parts`` order, from its schema arguments."""
        values = list(self._constants(flat[-1]))
        for i, v in zip(self.dynamic, flat):
            values[i] = v
        return values

    def _constants(self, text: str) -> list:
        """Every value of a call whose constants are ``text`` (None where dynamic),
        decoded once per distinct ``text``."""
        key = (self.name, text)
        values = _DECODED.get(key)
        if values is None:
            values = _DECODED[key] = self._decode(text)
        return values

    def prepared(self, text: str) -> tuple:
        """``(build, output format, quantized results, provenance)`` for calls whose
        constants are ``text``: ``build(flat)`` makes the args record (generated once
        per distinct ``text``)."""
        key = (self.name, text)
        found = _PREPARED.get(key)
        if found is None:
            values = self._constants(text)
            slot = {i: k for k, i in enumerate(self.dynamic)}
            n = len(self.parts) - len(_TAIL)
            sources = [("arg", slot[i]) if i in slot else ("const", values[i]) for i in range(n)]
            found = _PREPARED[key] = (record_builder(self.args_type, sources),
                                      _FORMAT.unflatten(values[n:-2]), *values[-2:])
        return found

    def _encode(self, values: list) -> str:
        out = []
        for i in self.static:
            v = values[i]
            if isinstance(v, torch.dtype):
                v = str(v)
            elif v is not None and not isinstance(v, (bool, int, float, str, list, tuple)):
                raise TypeError(f"fusible::{self.name}: {self.parts[i][0]} must be a constant "
                                f"of the graph ({self.parts[i][1]}), got {v!r}")
            out.append(v)
        return json.dumps(out, allow_nan=True)

    def _decode(self, text: str) -> list:
        values = [None] * len(self.parts)
        for i, v in zip(self.static, json.loads(text)):
            if v is not None and self.parts[i][1].startswith("ScalarType"):
                v = getattr(torch, v.removeprefix("torch."))
            values[i] = v
        return values


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
    return f"{_BASES[cls]}_{_SUFFIXES[direction]}"


_SUFFIXES = {"forward": "fwd", "backward": "bwd", "dgrad": "dgrad", "wgrad": "wgrad"}


def _kernel(cls, direction: str, op: StageOp, compute, real: bool = True):
    bound = functools.partial(compute, in_custom_op=True)
    check_recompute = real and direction == "forward"
    own_cast = cls.quantizes_own_output
    # Where tensors are among the schema arguments: the alias check looks only there.
    kinds = [op.parts[i][1] for i in op.dynamic]
    slots = tuple(i for i, p in enumerate(kinds) if p in ("Tensor", "Tensor?"))
    list_slots = tuple(i for i, p in enumerate(kinds) if p.startswith("Tensor") and "[]" in p)

    def kernel(*flat):
        if not real:  # a trace's: Inductor, if lowering it next, must find its fallback
            ensure_fallback(getattr(torch.ops.fusible, op.name).default)
        build, fmt, quantized, provenance = op.prepared(flat[-1])
        updated = []
        if op.states:
            flat, updated = _copied_states(flat, op.states)
            if updated and check_recompute:
                recompute.refuse_stateful(cls)
            if fmt is not None and fmt.stateful:
                fmt = fmt.bound(flat[op.tail_state])
        args = build(flat)
        if own_cast:  # the formats its kernels write; the others cast after it
            result = bound(args, output_format=fmt if fmt is None or fmt.kernel_cast else None)
        else:
            result = bound(args)
        if direction == "dgrad":  # queue the record its wgrad reads (a fake run: nothing)
            result, record = result
            if real:
                deferred.defer(_target_token(provenance), record, compiled=True)  # every
                # thread's: a compiled backward does not know its forward's thread
        inputs = [flat[i] for i in slots]
        if list_slots:
            inputs += [t for i in list_slots for t in flat[i]]
        if check_recompute:
            recompute.note_forward(cls, inputs, quantized)
        like = next(t for t in inputs if t is not None)
        return _unaliased(_flatten_result(result, direction, like, quantized, fmt),
                          inputs) + updated

    return kernel


_TARGET = " -> wgrad target "


def _with_target(provenance: str, token: int) -> str:
    """A dgrad stage's provenance with the token of its wgrad target, which its kernel
    reads to queue the record (a graph's constants travel in that string)."""
    return f"{provenance}{_TARGET}{token}"


def _target_token(provenance: str) -> int:
    return int(provenance.rsplit(_TARGET, 1)[1])


def _copied_states(flat, states: tuple) -> tuple:
    """``(flat with a copy in place of each given state, those copies)``."""
    flat = list(flat)
    copies = []
    for i in states:
        if flat[i] is not None:
            flat[i] = flat[i].clone()
            copies.append(flat[i])
    return flat, copies


def _write_back(out: list, flat: list, states: tuple) -> list:
    """The results without the updated states at their end, which go into the states."""
    given = [flat[i] for i in states if flat[i] is not None]
    if not given:
        return out
    for state, new in zip(given, out[len(out) - len(given):]):
        state.copy_(new)
    return out[:len(out) - len(given)]


def _flatten_result(result, direction: str, like, quantized: bool,
                    fmt: Optional[Float8Format]) -> list:
    if direction == "forward":
        if not isinstance(result, ForwardResult):
            raise TypeError(f"forward_compute must return a ForwardResult, got {result!r}")
        tensors = [to_format(result.output, fmt), *result.extra_outputs, *result.aux]
    else:
        if not isinstance(result, BackwardResult):
            raise TypeError(f"{direction}_compute must return a BackwardResult, got {result!r}")
        grad = result.grad_input
        tensors = [grad if grad is None else to_format(grad, fmt), *result.grad_params,
                   *result.grad_extra_inputs]
    return encode_results(tensors, quantized, like)


def _unaliased(outputs: list, inputs: list) -> list:
    """Copy every output that shares storage with an input or an earlier output: a custom
    op's results may alias nothing. (Inside the kernel views carry no ``_base``: storage
    is what tells.) ``inputs`` are the tensor arguments (None where absent)."""
    seen = {_storage_id(t) for t in inputs if t is not None}
    for k, t in enumerate(outputs):
        key = _storage_id(t)  # empty tensors too: each has a storage of its own
        if key in seen:
            t = outputs[k] = t.clone()
            key = _storage_id(t)
        seen.add(key)
    return outputs


def _register(cls, direction: str) -> StageOp:
    args_type = cls.fwd_args_type if direction == "forward" else cls.bwd_args_type
    if direction in ("dgrad", "wgrad") and getattr(cls, f"{direction}_compute") is None:
        raise TypeError(f"{cls.__name__} defines no {direction}_compute")
    fields = record_fields(args_type)
    name = _op_name(cls, direction)
    parts = tuple((fname if len(st.parts) == 1 else f"{fname}_{i}", part)
                  for fname, st in fields for i, part in enumerate(st.parts)) + _TAIL
    dynamic = tuple(i for i, (_, part) in enumerate(parts) if part in _DYNAMIC)
    static = tuple(i for i in range(len(parts)) if i not in dynamic)
    params = [f"{parts[i][1]} {parts[i][0]}" for i in dynamic] + ["str static"]
    _LIB.define(f"{name}({', '.join(params)}) -> Tensor[]")
    tail_state = len(parts) - len(_TAIL) + _FORMAT.states[0]
    states = tuple(dynamic.index(i) for i in (*state_parts(fields), tail_state))
    op = StageOp(name, args_type, fields, parts, dynamic, static, states,
                 dynamic.index(tail_state))
    compute = getattr(cls, f"{direction}_compute")
    fake = getattr(cls, f"{direction}_fake", None) or compute
    _LIB.impl(name, fresh_zeros_inside(_kernel(cls, direction, op, compute)),
              "CompositeExplicitAutograd")
    torch.library.register_fake(f"fusible::{name}",
                                _kernel(cls, direction, op, fake, real=False), lib=_LIB)
    op = attrs.evolve(op, overload=getattr(torch.ops.fusible, name).default)
    if direction == "dgrad":  # it queues the wgrad's record: kept even when dx is unused
        torch.fx.node.has_side_effect(op.overload)
    _BY_NAME[name] = op
    return op


def stage_op(cls, direction: str) -> StageOp:
    """The custom op of ``cls`` for ``direction``, registered on first use.

    Raises TypeError naming the class when its args cannot become a schema.
    """
    reason = unsupported_reason(cls, direction)
    if reason is not None:
        raise TypeError(reason)
    return _OPS[(cls, direction)]


def stage_op_named(name: str) -> Optional[StageOp]:
    """The registered stage op called ``name`` (without namespace), or None."""
    return _BY_NAME.get(name)


def unsupported_reason(cls, direction: str) -> Optional[str]:
    """Why ``cls`` cannot run compiled in ``direction`` (registering it first), or None."""
    key = (cls, direction)
    if key not in _OPS and key not in _REASONS:
        try:
            _OPS[key] = _register(cls, direction)
        except Exception as error:  # no schema type, an annotation that does not resolve,
            # a schema torch rejects: the stage runs eagerly, and the plan says why
            detail = error if isinstance(error, TypeError) else f"{type(error).__name__}: {error}"
            _REASONS[key] = f"{cls.__name__} ({direction}): {detail}"
    return _REASONS.get(key)


def _call(stage, direction: str, args, quantized: bool, outer_dtype, output_format,
          provenance: "str | None" = None):
    op = stage_op(stage.op.__class__, direction)
    flat = op.flatten_call(args, output_format, quantized, provenance or stage.provenance)
    if recorder is not None:
        recorder.append((op.overload, tuple(flat)))
    out = _write_back(op.overload(*flat), flat, op.states)
    return op, decode_results(out, quantized, outer_dtype)


def call_forward(stage, args, quantized: bool = False, outer_dtype=None,
                 output_format=_UNSET) -> ForwardResult:
    """Run a forward stage through its custom op.

    ``quantized``: results may be Float8Tensors (an FP8 recipe is in effect), which
    dequantize to ``outer_dtype``, the pipeline's dtype. ``output_format``: the stage's
    (bound to the next op's state, where stateful); default ``stage.output_format``.
    """
    fmt = stage.output_format if output_format is _UNSET else output_format
    _, out = _call(stage, "forward", args, quantized, outer_dtype, fmt)
    k = stage.num_extra_out
    return ForwardResult(out[0], tuple(out[1:1 + k]), tuple(out[1 + k:]))


def call_backward(stage, args, quantized: bool = False, outer_dtype=None,
                  output_format=_UNSET) -> BackwardResult:
    """Run a backward stage through its custom op; placeholders become None
    (``output_format`` as in :func:`call_forward`)."""
    fmt = stage.output_format if output_format is _UNSET else output_format
    return _backward_result(stage, "backward", args, quantized, outer_dtype, fmt,
                            stage.grad_mask)


def call_dgrad(stage, split, args, quantized: bool = False, outer_dtype=None,
               output_format=_UNSET) -> BackwardResult:
    """Run a split stage's dgrad through its custom op, which queues the record its wgrad
    reads (``split``: the stage's SplitStage, whose target's token the op's provenance
    carries); the deferred parameters' gradients come back None."""
    fmt = stage.output_format if output_format is _UNSET else output_format
    needed, params, extras = stage.grad_mask
    params = tuple(n and not d for n, d in zip(params, split.deferred))
    return _backward_result(stage, "dgrad", args, quantized, outer_dtype, fmt,
                            (needed, params, extras),
                            _with_target(stage.provenance, split.target.token))


def call_wgrad(stage, split, record) -> BackwardResult:
    """Run a split stage's deferred wgrad through its custom op."""
    _, params, extras = stage.grad_mask
    mask = (False, tuple(n and d for n, d in zip(params, split.deferred)),
            (False,) * len(extras))
    return _backward_result(stage, "wgrad", record, False, None, None, mask)


def _backward_result(stage, direction, args, quantized, outer_dtype, fmt, mask,
                     provenance=None):
    op, out = _call(stage, direction, args, quantized, outer_dtype, fmt, provenance)
    input_needed, params_needed, extras_needed = mask
    expected = 1 + len(params_needed) + len(extras_needed)
    if len(out) != expected:
        raise RuntimeError(f"{op.name} returned {len(out)} gradients, expected {expected}")
    np_ = len(params_needed)
    return BackwardResult(out[0] if input_needed else None,
                          tuple(g if n else None for g, n in zip(out[1:1 + np_], params_needed)),
                          tuple(g if n else None for g, n in zip(out[1 + np_:], extras_needed)))
