"""Operations written outside the library compile too; those that cannot say why."""

import logging
import attrs
import pytest
import torch

import fusible
from fusible import ops
from fusible.ops import BackwardResult, BasicOperation, ForwardResult
from fusible.runtime.custom_ops import stage_op
from fusible.testing import check_against_reference, exact_tensor
from custom_operation import ScaledCube  # examples/custom_operation.py, the docs' example


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_user_defined_op_compiles_without_graph_breaks():
    model = ops.Sequential(ops.Linear(4, 6), ScaledCube(0.5), ops.Linear(6, 2))
    x = torch.randn(3, 4, requires_grad=True)
    report = fusible.compile_report(model, x)
    assert report.graph_breaks == ()
    # the op's name: ScaledCube_fwd, qualified where another ScaledCube (a docs page's)
    # took that name first in this process
    fwd, bwd = (f"fusible::{stage_op(ScaledCube, d).name}" for d in ("forward", "backward"))
    assert fwd.endswith("ScaledCube_fwd") and bwd.endswith("ScaledCube_bwd")
    assert fwd in [c.op for c in report.forward_graphs[0].fusible_ops]
    assert bwd in [c.op for c in report.backward_graphs[0].fusible_ops]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert torch.equal(y, model(x))


def test_user_defined_op_matches_its_reference():
    model = ops.Sequential(ops.BasicLinear(4, 6), ScaledCube(0.5))
    check_against_reference(model, exact_tensor((3, 4)).requires_grad_())


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
    (reason,) = report.graph_breaks  # once, however often dynamo met it
    assert "TableScale" in reason


def test_a_model_with_an_uncompilable_stage_runs_eagerly_as_a_whole():
    """Many groups after the uncompilable one: no per-group recompilations."""
    layers = [TableScale()] + [m for _ in range(12) for m in (torch.nn.Tanh(), ops.Linear(4, 4))]
    model = ops.Sequential(*layers)
    x = torch.randn(3, 4, requires_grad=True)
    report = fusible.compile_report(model, x)
    assert len(report.graph_breaks) == 1 and report.recompilations == 0
    assert torch.equal(torch.compile(model, backend="aot_eager")(x), model(x))


class TableView(TableScale):
    """An op of views only: traced inline when compiled, so its args need no schema."""

    def inline_when_compiled(self, direction):
        return True

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input.view(-1, *args.input.shape[-1:]))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.input)


def test_an_inline_stage_compiles_without_a_schema():
    model = ops.Sequential(ops.Linear(4, 4), TableView(), ops.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    plan = model.plan(x)
    assert plan.forward[1].compile_reason is None and plan.forward[1].inline_when_compiled
    assert "compiles inline" in plan.explain()
    x2 = x.detach().clone().requires_grad_()
    y = torch.compile(model, fullgraph=True, backend="aot_eager")(x2)
    assert torch.equal(y, model(x))
    y.sum().backward()


@attrs.define
class _SquareArgs:
    input: torch.Tensor


class MonitoredSquare(BasicOperation):
    """``y = x**2`` that, eagerly only, records the largest |x| it saw into a Python list:
    an eager-only side effect, decided by ``in_custom_op`` (inside the custom op, real or
    fake kernel, it would record a fake tensor at trace time, or run in a graph that
    replays no Python)."""

    fwd_args_type = bwd_args_type = _SquareArgs
    seen: list = []

    def forward_args(self, input, params, extra_inputs, ctxs):
        return _SquareArgs(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        if not in_custom_op:
            cls.seen.append(float(args.input.abs().max()))
        return ForwardResult(args.input * args.input)

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = None

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return _SquareArgs(grad_output)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(None)


def test_a_compute_branching_on_in_custom_op_keeps_its_side_effect_eager():
    """The flag is True in the stage's custom op (its real and its fake kernel) and False
    eagerly: the eager-only side effect runs once per eager call and never compiled, and
    the results are the same bits on both paths."""
    model = ops.Sequential(ops.BasicLinear(4, 4), MonitoredSquare())
    for p in model.parameters():
        p.requires_grad_(False)
    x = exact_tensor((3, 4))
    MonitoredSquare.seen.clear()
    eager = model(x)
    assert MonitoredSquare.seen == [float((x @ model[0].weight.t()).abs().max())]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    report = fusible.compile_report(model, x)
    assert "fusible::MonitoredSquare_fwd" in [c.op for c in report.forward_graphs[0].fusible_ops]
    MonitoredSquare.seen.clear()
    y = compiled(x)
    assert MonitoredSquare.seen == [] and torch.equal(y, eager)
