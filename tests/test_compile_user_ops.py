"""Operations written outside the library compile too; those that cannot say why."""

import logging
from typing import Optional

import attrs
import pytest
import torch

import fusible
from fusible import ops
from fusible.ops import BackwardResult, BasicOperation, ForwardResult


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


@attrs.define
class CubeArgs:
    input: torch.Tensor
    scale: float


@attrs.define
class CubeBackwardArgs:
    grad_output: torch.Tensor
    input: Optional[torch.Tensor]
    scale: float
    need_grad_input: bool


class ScaledCube(BasicOperation):
    """``y = scale * x**3``: a user-defined op with its own args and compute methods."""

    fwd_args_type = CubeArgs
    bwd_args_type = CubeBackwardArgs
    saved_fields = ("input",)

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward_args(self, input, params, extra_inputs, ctxs):
        return CubeArgs(input, self.scale)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.scale * args.input ** 3)

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = (args.input if ctxs[0].needs.input else None,)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return CubeBackwardArgs(grad_output, ctxs[0].saved[0], self.scale, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(args.grad_output * 3 * args.scale * args.input ** 2)


def test_user_defined_op_compiles_without_graph_breaks():
    model = ops.Sequential(ops.Linear(4, 6), ScaledCube(0.5), ops.Linear(6, 2))
    x = torch.randn(3, 4, requires_grad=True)
    report = fusible.compile_report(model, x)
    assert report.graph_breaks == ()
    assert "fusible::ScaledCube_fwd" in [c.op for c in report.forward_graphs[0].fusible_ops]
    assert "fusible::ScaledCube_bwd" in [c.op for c in report.backward_graphs[0].fusible_ops]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert torch.equal(y, model(x))


@attrs.define
class LookupArgs:
    input: torch.Tensor
    table: dict  # no custom-op schema type for a dict


class TableScale(BasicOperation):
    """An op whose args cannot cross a custom-op boundary."""

    fwd_args_type = LookupArgs
    bwd_args_type = LookupArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return LookupArgs(input, {"scale": 2.0})

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input * args.table["scale"])

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return LookupArgs(grad_output, {"scale": 2.0})

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.input * args.table["scale"])


def test_unsupported_stage_is_explained_an_error_or_a_logged_graph_break(caplog):
    model = ops.Sequential(ops.Linear(4, 4), TableScale())
    x = torch.randn(3, 4, requires_grad=True)
    plan = model.plan(x)
    reason = plan.forward[1].compile_reason
    assert "TableScale (forward): field LookupArgs.table: no custom-op schema type" in reason
    assert "EAGER ONLY" in plan.explain() and "not compilable" in plan.to_dot()
    with pytest.raises(Exception, match=r"stage TableScale at \[2\] cannot be compiled: "
                                        r"TableScale \(forward\): field LookupArgs.table"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="fusible"):
        y = torch.compile(model, backend="aot_eager")(x)
    assert torch.equal(y, model(x))
    assert any("TableScale" in r.getMessage() and "graph break" in r.getMessage()
               for r in caplog.records)
    report = fusible.compile_report(model, x)
    assert any("TableScale" in reason for reason in report.graph_breaks)
