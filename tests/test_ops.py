"""Every basic op against plain-PyTorch FP64 references, in every dtype."""

import pytest
import torch

from fusible import ops
from fusible.testing import check_against_reference, exact_parameters_, exact_tensor, stage_names

# (name, op factory, input feature size). Each op runs after a BasicLinear (and an
# Identity, so that nothing fuses) so that its dgrad is exercised and reaches a parameter.
OPS = [
    ("BasicLinear", lambda: ops.BasicLinear(8, 12), 8),
    ("Bias", lambda: ops.Bias(8), 8),
    ("GELU", lambda: ops.GELU(), 8),
    ("GELU", lambda: ops.GELU(approximate="tanh"), 8),
    ("ReLU", lambda: ops.ReLU(), 8),
    ("SiLU", lambda: ops.SiLU(), 8),
    ("SwiGLU", lambda: ops.SwiGLU(), 8),
    ("Identity", lambda: ops.Identity(), 8),
    ("Reshape", lambda: ops.Reshape((-1, 4)), 8),
    ("ConstantScale", lambda: ops.ConstantScale(-0.75), 8),
    ("LayerNorm", lambda: ops.LayerNorm(8), 8),
    ("RMSNorm", lambda: ops.RMSNorm(8), 8),
]


def _model(op, features, dtype):
    return exact_parameters_(ops.Sequential(ops.BasicLinear(6, features), ops.Identity(), op)
                             .to(dtype))


@pytest.mark.parametrize("name,factory,features", OPS, ids=[f"{o[0]}{i}" for i, o in
                                                               enumerate(OPS)])
@pytest.mark.parametrize("lead", [(5,), (2, 3), (2, 1, 3)], ids=lambda s: f"lead{len(s)}")
def test_op_matches_fp64_reference(name, factory, features, lead, dtype):
    op = factory()
    model = _model(op, features, dtype)
    for p in op.parameters():  # non-zero parameters exercise their gradients
        p.data = exact_tensor(p.shape, dtype)
    x = exact_tensor((*lead, 6), dtype).requires_grad_()
    plan = model.plan(x)
    assert stage_names(plan.forward) == ["BasicLinear", "Identity", name]
    assert stage_names(plan.backward) == [name, "Identity", "BasicLinear"]
    check_against_reference(model, x)


@pytest.mark.parametrize("name,factory,features", OPS[:6], ids=[o[0] for o in OPS[:6]])
def test_op_alone_on_input(name, factory, features, dtype):
    """First op of the pipeline: its dgrad goes to the input."""
    op = exact_parameters_(factory().to(dtype))
    x = exact_tensor((4, features), dtype).requires_grad_()
    check_against_reference(ops.Sequential(op), x)


def test_linear_composite_matches_reference(dtype):
    model = exact_parameters_(ops.Sequential(ops.Linear(6, 10), ops.Linear(10, 4, bias=False))
                              .to(dtype))
    x = exact_tensor((3, 6), dtype).requires_grad_()
    assert stage_names(model.plan(x).forward) == ["ForwardLinearBias", "BasicLinear"]
    check_against_reference(model, x)


def test_extra_input_and_output(dtype):
    model = exact_parameters_(ops.Sequential(
        ops.MakeExtraOutput(), ops.BasicLinear(6, 6), ops.ReLU(), ops.AddExtraInput(),
        ops.MakeExtraOutput(), ops.ConstantScale(2.0)).to(dtype))
    x = exact_tensor((2, 3, 6), dtype).requires_grad_()
    residual = exact_tensor((2, 3, 6), dtype).requires_grad_()
    y, branch1, branch2 = model(x, residual)
    assert branch1 is not None and branch2.shape == y.shape
    x.grad = None
    check_against_reference(model, x, residual)


def test_op_standalone_module_call():
    op = ops.BasicLinear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = op(x)
    torch.testing.assert_close(y, x @ op.weight.T, rtol=0, atol=0)
    y.sum().backward()
    assert op.weight.grad is not None and x.grad is not None
