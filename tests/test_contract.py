"""The declared op contract: hooks checked at class creation, typed saved records and GEMM
records, FP8 formats asked for by consumers, fusions' FP8 declarations, priorities."""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Optional

import attrs
import pytest
import torch

import fusible
from fusible import FusedOperation, Op, Pattern, ops
from fusible.functional.linear import gemm_forward
from fusible.functional.linear_records import GemmForwardArgs
from fusible.ops import BackwardResult, BasicOperation, ForwardResult
from fusible.testing import check_fusion, exact_tensor, stage_names
from naive_plugins import ActivationBiasKeepdim, GeluOfLinear, GeluOfLinearWrongLayout

ROOT = pathlib.Path(__file__).parent.parent


@attrs.define
class _Args:
    input: torch.Tensor


@attrs.define
class _Saved:
    input: Optional[torch.Tensor]


def _hooks():
    """The body of a complete basic op: y = 2 x."""
    return {
        "fwd_args_type": _Args, "bwd_args_type": _Args, "saved_type": _Saved,
        "forward_args": lambda self, x, p, e, c: _Args(x),
        "forward_compute": classmethod(lambda cls, a, *, in_custom_op=False:
                                       ForwardResult(a.input * 2)),
        "save_for_backward": lambda self, a, r, c: None,
        "backward_args": lambda self, dy, de, c: _Args(dy),
        "backward_compute": classmethod(lambda cls, a, *, in_custom_op=False:
                                        BackwardResult(a.input * 2)),
    }


@pytest.mark.parametrize("hook", ["fwd_args_type", "bwd_args_type", "forward_args",
                                  "forward_compute", "save_for_backward", "backward_args",
                                  "backward_compute"])
def test_a_basic_op_without_a_hook_fails_at_class_creation(hook):
    body = _hooks()
    del body[hook]
    with pytest.raises(TypeError, match=rf"basic operation Doubler \(\w+ward\) must define "
                                        rf".*{hook}"):
        type("Doubler", (BasicOperation,), body)


def test_malformed_hooks_are_named():
    body = dict(_hooks(), forward_compute=classmethod(lambda cls, a: ForwardResult(a.input)))
    with pytest.raises(TypeError, match="Doubler: forward_compute must take the keyword "
                                        "argument.*in_custom_op"):
        type("Doubler", (BasicOperation,), body)
    with pytest.raises(TypeError, match="Doubler: backward_compute must be a classmethod"):
        type("Doubler", (BasicOperation,), dict(_hooks(), backward_compute=lambda s, a: None))
    with pytest.raises(TypeError, match="Doubler.saved_type must be an attrs class"):
        type("Doubler", (BasicOperation,), dict(_hooks(), saved_type=tuple))
    with pytest.raises(TypeError, match="Doubler.param_names must be a tuple of str"):
        type("Doubler", (BasicOperation,), dict(_hooks(), param_names="weight"))


def test_abstract_bases_may_leave_hooks_to_subclasses():
    base = type("Half", (BasicOperation,), {"fwd_args_type": _Args}, abstract=True)
    with pytest.raises(TypeError, match="basic operation Leaf"):
        type("Leaf", (base,), {})
    leaf = type("Leaf", (base,), {k: v for k, v in _hooks().items() if k != "fwd_args_type"})
    x = torch.randn(3, requires_grad=True)
    leaf()(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_a_fusion_that_saves_another_layout_is_named(plugins):
    plugins.fusion(GeluOfLinearWrongLayout)
    model = ops.Sequential(ops.BasicLinear(16, 16), ops.GELU())
    with pytest.raises(TypeError, match=r"the stage covering BasicLinear\(in_features=16.* saved "
                                        r"a tuple; BasicLinear reads a LinearSaved"):
        model(torch.randn(4, 16, requires_grad=True))


def test_fp8_plugin_contract_refuses_an_undeclared_fusion_under_a_recipe(plugins):
    plugins.fusion(GeluOfLinear)
    model = ops.Sequential(ops.BasicLinear(16, 16), ops.GELU())
    x = torch.randn(16, 16)
    with torch.no_grad():
        assert stage_names(model.plan(x).forward) == ["GeluOfLinear"]
        with fusible.autocast():
            plan = model.plan(x)
            y = model(x)
    assert stage_names(plan.forward) == ["BasicLinear", "GELU"]
    (refusal,) = [c for c in plan.candidates if c.fusion == "GeluOfLinear"]
    assert refusal.status == "refused"
    assert "quantizes in the forward pass" in refusal.reason
    assert "does not declare input_format()" in refusal.reason
    assert y.shape == (16, 16)


def test_a_fusion_over_ops_that_do_not_quantize_needs_no_declaration(plugins):
    """The documentation's plugin (examples/plugin_fusion.py) declares no formats and is
    still chosen under FP8: ConstantScale and Bias quantize nothing."""
    spec = importlib.util.spec_from_file_location("plugin_fusion_copy",
                                                  ROOT / "examples" / "plugin_fusion.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers ForwardScaleBias
    model = ops.Sequential(ops.ConstantScale(0.5), ops.Bias(16), ops.BasicLinear(16, 16))
    x = torch.randn(16, 16, requires_grad=True)
    with fusible.autocast():
        assert stage_names(model.plan(x).forward) == ["ForwardScaleBias", "BasicLinear"]
        model(x).sum().backward()
    assert torch.isfinite(x.grad).all()


class _ToFp8Identity(ops.Identity):
    """A parameterless FP8 consumer: it asks for its input in E4M3."""

    def input_format(self, recipe, needs):
        return recipe.input_format()


def test_a_parameterless_consumer_gets_its_input_in_its_format():
    seen = []
    real = ops.Identity.forward_compute.__func__

    def spy(cls, args, *, in_custom_op=False):
        seen.append(type(args.input))
        return real(cls, args, in_custom_op=in_custom_op)

    model = ops.Sequential(ops.BasicLinear(16, 16), _ToFp8Identity(), ops.GELU())
    x = exact_tensor((16, 16)).requires_grad_()
    try:
        _ToFp8Identity.forward_compute = classmethod(spy)
        with fusible.autocast():
            y = model(x)
    finally:
        del _ToFp8Identity.forward_compute
    assert seen == [fusible.Float8Tensor]
    ref = torch.nn.functional.gelu(fusible.quantize(x @ model[0].weight.t()).dequantize())
    y.sum().backward()
    assert torch.allclose(y, ref, rtol=0.1, atol=0.05) and x.grad is not None


@attrs.define
class _BadGemmArgs:
    input: torch.Tensor
    weight: torch.Tensor


def test_gemm_helpers_take_their_typed_record_in_every_precision():
    with pytest.raises(TypeError, match="gemm_forward takes a GemmForwardArgs"):
        gemm_forward(_BadGemmArgs(torch.randn(2, 4), torch.randn(3, 4)))
    with pytest.raises(TypeError):  # a record missing a field fails where it is built
        GemmForwardArgs(torch.randn(2, 4), torch.randn(3, 4))


def test_priority_breaks_ties_before_registration_order(plugins):
    def pair(name, priority):
        body = dict(direction="forward", priority=priority,
                    pattern=Pattern(Op(ops.Identity), Op(ops.Identity)), fwd_args_type=_Args,
                    forward_args=lambda self, x, p, e, c: _Args(x),
                    forward_compute=classmethod(lambda cls, a, *, in_custom_op=False:
                                                ForwardResult(a.input)),
                    save_for_backward=lambda self, a, r, c: None)
        return type(name, (FusedOperation,), body)

    plugins.fusion(pair("First", 0))
    plugins.fusion(pair("Urgent", 5))
    plan = ops.Sequential(ops.Identity(), ops.Identity()).plan()
    assert stage_names(plan.forward) == ["Urgent"]
    (first,) = [c for c in plan.candidates if c.fusion == "First"]
    assert first.status == "superseded"


def test_a_users_fusions_module_shadows_nothing(tmp_path):
    """The built-ins live in fusible.fusions: a fusions.py of the user's changes nothing."""
    (tmp_path / "fusions.py").write_text("raise ImportError('the user module was imported')\n")
    script = textwrap.dedent("""
        import torch
        from fusible import ops
        model = ops.Sequential(ops.Linear(8, 8))
        print([s.name for s in model.plan(torch.randn(2, 8)).forward])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['ForwardLinearBias']"


def test_no_builtin_compute_reads_in_custom_op():
    """The flag means one thing (eager-only side effects may run): the custom-op boundary
    copies aliased results, so no built-in op or fusion branches on it to copy by hand."""
    readers = []
    for path in [*(ROOT / "fusible" / "ops").glob("*.py"), *(ROOT / "fusions").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "in_custom_op":
                readers.append(f"{path.name}:{node.lineno}")
    assert not readers, readers


def test_compile_reasons_are_plan_data():
    model = ops.Sequential(ops.Linear(8, 8), ops.GELU())
    plan = model.plan()
    assert all(s.compile_reason is None for s in plan.forward)
    assert plan.conditions.training and plan.conditions.recipe_key is None
    model.eval()
    assert not model.plan().conditions.training


def test_check_fusion_also_checks_compiled_and_runs_under_no_grad():
    """check_fusion's compiled comparison holds with grad disabled (no gradients on either
    side), and fails when the compiled path computes other bits."""
    model = ops.Sequential(ops.BasicLinear(8, 16), ops.Bias(16))
    x = exact_tensor((4, 8))
    with torch.no_grad():
        check_fusion(model, x, forward=["ForwardLinearBias"])
    from fusible.testing import same_bits
    assert same_bits(None, None) and not same_bits(torch.ones(2), None)
    assert not same_bits(torch.ones(2), torch.ones(2).nextafter(torch.full((2,), 2.0)))


@attrs.frozen
class _ExpSaved:
    output: Optional[torch.Tensor]


@attrs.define
class _ExpBackwardArgs:
    grad_output: torch.Tensor
    output: Optional[torch.Tensor]


class _Exp(BasicOperation):
    """``y = exp(x)``, saving its output in a frozen record."""

    fwd_args_type, bwd_args_type, saved_type = _Args, _ExpBackwardArgs, _ExpSaved

    def forward_args(self, input, params, extra_inputs, ctxs):
        return _Args(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input.exp())

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = _ExpSaved(result.output if ctxs[0].needs.input else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return _ExpBackwardArgs(grad_output, ctxs[0].saved.output)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.grad_output * args.output)


def test_saved_records_may_be_frozen():
    """The fuser swaps saved outputs and views in and out of the record; frozen is fine."""
    x = torch.randn(4, 8, requires_grad=True)
    ops.Sequential(_Exp(), ops.Reshape((-1,)))(x).sum().backward()
    assert torch.allclose(x.grad, x.exp())
    h = torch.randn(2, 8)
    y = ops.Sequential(ops.Reshape((-1, 4)), _Exp())(h.requires_grad_())  # saves a view
    y.sum().backward()
    assert torch.allclose(h.grad, h.exp())


def test_a_parameter_gradient_of_another_shape_is_an_error(plugins):
    """Autograd would sum a (1, n) gradient down to the (n,) bias silently."""
    plugins.fusion(ActivationBiasKeepdim)
    model = ops.Sequential(ops.Bias(8), ops.ReLU())
    x = torch.randn(4, 8, requires_grad=True)
    assert stage_names(model.plan(x).backward) == ["ActivationBiasKeepdim"]
    with pytest.raises(RuntimeError, match=r"ActivationBiasKeepdim returned a gradient of "
                                           r"shape \(1, 8\) for Bias\(size=8\)'s bias, whose "
                                           r"shape is \(8,\)"):
        model(x).sum().backward()


def test_every_package_is_in_the_distribution():
    """A package folder missing from pyproject.toml's list is missing from every wheel
    (an editable install does not notice)."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', text.split("\npackages = [", 1)[1].split("]", 1)[0]))
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "fusible").rglob("__init__.py")} | {"fusible.fusions"}
    assert found == listed, (sorted(found - listed), sorted(listed - found))
