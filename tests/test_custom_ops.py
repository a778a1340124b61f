"""Schemas derived from attrs args classes: every supported field type, and extensions."""

import enum
from typing import Optional

import attrs
import pytest
import torch

from fusible import ops
from fusible.core.schema import SchemaType, register_schema_type
from fusible.ops import BackwardResult, BasicOperation, ForwardResult
from fusible.runtime import custom_ops


class Mode(enum.Enum):
    ADD = 1
    MUL = 2


class Pair:
    """A field type the schema does not know: taught with register_schema_type."""

    def __init__(self, a, b):
        self.a, self.b = a, b


register_schema_type(Pair, SchemaType(("Tensor", "Tensor"), lambda p: [p.a, p.b],
                                      lambda vals: Pair(*vals)))


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
    op = custom_ops.stage_op(EveryType, "forward")
    schema = str(op.overload._schema)
    for part in ("Tensor input", "Tensor? maybe", "Tensor[] tensors", "SymInt count",
                 "float factor", "bool flag", "str label", "ScalarType dtype", "SymInt[] sizes",
                 "SymInt[] dims", "str mode", "Tensor pair_0", "Tensor pair_1",
                 "float inner_0", "Tensor? inner_1", "str provenance"):
        assert part in schema, (part, schema)


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
