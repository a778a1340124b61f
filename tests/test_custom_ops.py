"""Schemas derived from attrs args classes: every supported field type, and extensions."""

import enum
import sys
import textwrap
import types
from typing import Optional

import attrs
import pytest
import torch

from fusible import ops
from fusible.core.schema import SchemaType, unflatten_record
from fusible.ops import BackwardResult, BasicOperation, ForwardResult
from fusible.quantization.format import Float8Format
from fusible.runtime import custom_ops


class Mode(enum.Enum):
    ADD = 1
    MUL = 2


class Pair:
    """A field type the schema does not know: taught with register_schema_type."""

    def __init__(self, a, b):
        self.a, self.b = a, b


PAIR = SchemaType(("Tensor", "Tensor"), lambda p: [p.a, p.b], lambda vals: Pair(*vals))


@pytest.fixture(autouse=True)
def pair_crosses_custom_ops(plugins):
    """Pair taught to the schema derivation for each test (undone after it)."""
    plugins.schema_type(Pair, PAIR)


@attrs.define
class Inner:
    """A nested attrs record: flattened field by field, rebuilt inside the op."""
    scale: float
    shift: Optional[torch.Tensor]


@attrs.define
class EveryTypeArgs:
    input: torch.Tensor
    maybe: Optional[torch.Tensor]
    tensors: list[torch.Tensor]
    count: int
    factor: float
    flag: bool
    label: str
    dtype: torch.dtype
    sizes: list[int]
    dims: tuple[int, ...]
    mode: Mode
    pair: Pair
    inner: Inner


class EveryType(BasicOperation):
    fwd_args_type = EveryTypeArgs
    bwd_args_type = EveryTypeArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return EveryTypeArgs(input, None, [input, input * 2], 3, 0.5, True, "x", torch.float32,
                             [1, 2], (0,), Mode.MUL, Pair(input, input + 1), Inner(2.0, None))

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        assert args.maybe is None and args.label == "x" and args.dtype == torch.float32
        assert isinstance(args.dims, tuple) and args.sizes == [1, 2] and args.mode is Mode.MUL
        assert isinstance(args.inner, Inner) and args.inner.shift is None
        y = (sum(args.tensors) * args.count * args.factor + args.pair.b - args.pair.a) \
            * args.inner.scale / 2
        return ForwardResult(y if args.flag else -y)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return self.forward_args(grad_output, (), (), ctxs)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.input * 4.5)


def test_schema_of_every_field_type():
    """Tensors and integers are schema arguments; the graph's constants travel in one
    string, and come back as they went."""
    op = custom_ops.stage_op(EveryType, "forward")
    schema = str(op.overload._schema)
    assert schema == ("fusible::EveryType_fwd(Tensor input, Tensor? maybe, Tensor[] tensors, "
                      "SymInt count, SymInt[] sizes, SymInt[] dims, Tensor pair_0, "
                      "Tensor pair_1, Tensor? inner_1, Tensor? output_format_3, str static) "
                      "-> Tensor[]"), schema
    assert op.states == (op.tail_state,) == (9,)  # the output format's state: updated
    static = [name for name, _ in (op.parts[i] for i in op.static)]
    assert static == ["factor", "flag", "label", "dtype", "mode", "inner_0", "output_format_0",
                      "output_format_1", "output_format_2", "quantized_results", "provenance"]
    x = torch.ones(2)
    fmt = Float8Format(torch.float8_e5m2)
    args = EveryType().forward_args(x, (), (), None)
    args.factor = float("inf")  # JSON's extension, back exactly
    flat = op.flatten_call(args, fmt, True, "here")
    assert all(isinstance(v, (torch.Tensor, list, tuple, int, type(None))) for v in flat[:-1])
    values = op.expand(flat)
    rebuilt = unflatten_record(EveryTypeArgs, op.fields, values)
    assert rebuilt.factor == float("inf") and rebuilt.dtype is torch.float32
    assert rebuilt.mode is Mode.MUL and rebuilt.inner == Inner(2.0, None)
    assert values[-6:] == custom_ops._FORMAT.flatten(fmt) + [True, "here"]
    assert values[-6] is torch.float8_e5m2


def test_a_value_that_is_not_a_constant_is_named():
    op = custom_ops.stage_op(EveryType, "forward")
    args = EveryType().forward_args(torch.ones(2), (), (), None)
    args.label = object()
    with pytest.raises(TypeError, match="EveryType_fwd: label must be a constant"):
        op.flatten_call(args, None, False, "p")


def test_every_field_type_compiles_and_matches_eager():
    torch._dynamo.reset()
    model = ops.Sequential(ops.BasicLinear(3, 3), EveryType())
    x = torch.randn(2, 3, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y, y2 = model(x), compiled(x)
    assert torch.equal(y, y2)
    torch.testing.assert_close(y, (x @ model[0].weight.T) * 4.5 + 1)
    y2.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), 4.5) @ model[0].weight)


def test_unknown_field_type_is_named():
    @attrs.define
    class Bad:
        input: torch.Tensor
        lookup: dict

    class Op(EveryType):
        fwd_args_type = Bad

    reason = custom_ops.unsupported_reason(Op, "forward")
    assert "field Bad.lookup: no custom-op schema type for <class 'dict'>" in reason
    with pytest.raises(TypeError, match="Bad.lookup"):
        custom_ops.stage_op(Op, "forward")


def test_same_class_names_get_distinct_ops():
    def make():
        class Twin(EveryType):  # same __name__ each time, like a re-run notebook cell
            pass
        return Twin

    first, second = make(), make()
    assert custom_ops.unsupported_reason(first, "forward") is None  # forward only, first
    assert custom_ops.unsupported_reason(second, "forward") is None
    assert custom_ops.unsupported_reason(second, "backward") is None
    names = {custom_ops.stage_op(c, d).name for c in (first, second) for d in ("forward",)}
    assert len(names) == 2 and "Twin_fwd" in names
    assert custom_ops.stage_op(second, "backward").name.endswith("Twin_bwd")
    assert custom_ops.stage_op(second, "backward").name != "Twin_bwd"


@attrs.define(kw_only=True)
class KeywordArgs:
    input: torch.Tensor
    scale: float


class KeywordScale(BasicOperation):
    """Args records with keyword-only fields cross the boundary too."""

    fwd_args_type = bwd_args_type = KeywordArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return KeywordArgs(input=input, scale=2.0)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input * args.scale)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return KeywordArgs(input=grad_output, scale=2.0)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.input * args.scale)


def test_keyword_only_records_compile():
    torch._dynamo.reset()
    model = ops.Sequential(KeywordScale())
    x = torch.randn(4, 8, requires_grad=True)
    torch.compile(model, fullgraph=True, backend="aot_eager")(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4, 8), 2.0))


def test_an_annotation_that_does_not_resolve_leaves_the_op_eager_with_a_reason():
    module = types.ModuleType("typing_only_args")
    sys.modules[module.__name__] = module  # where attrs resolves the annotations
    exec(textwrap.dedent("""
        from __future__ import annotations
        import attrs, torch

        @attrs.define
        class Args:
            input: torch.Tensor
            thing: Thing  # only a type checker would know
    """), module.__dict__)
    namespace = module.__dict__

    class Unresolved(KeywordScale):
        fwd_args_type = namespace["Args"]

        def forward_args(self, input, params, extra_inputs, ctxs):
            return namespace["Args"](input, None)

        @classmethod
        def forward_compute(cls, args, *, in_custom_op=False):
            return ForwardResult(args.input * 2.0)

    model = ops.Sequential(Unresolved())
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()  # eagerly fine
    reason = model.plan(x).forward[0].compile_reason
    assert "NameError" in reason and "Thing" in reason


def test_empty_results_that_alias_an_input_are_copied():
    """With zero tokens Identity and Reshape return their input: the boundary copies it."""
    op = custom_ops.stage_op(ops.Identity, "forward")
    x = torch.randn(0, 8)
    args = tuple(op.flatten_call(ops.Identity.fwd_args_type(x), None, False, "p"))
    (out,) = op.overload(*args)
    assert out.shape == (0, 8) and out is not x
    assert torch._C._storage_id(out) != torch._C._storage_id(x)
    torch.library.opcheck(op.overload, args)
