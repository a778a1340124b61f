"""in_place on AddExtraInput and MakeExtraOutput (TransformerEngine's option): the same
values and gradients as out of place; the forward sum written into the extra input, fused
GEMMs accumulating there; the backward's flag accepted but never writing into autograd's
gradient buffers (which several consumers may share); eager and compiled."""

import contextlib

import pytest
import torch

import fusible
from fusible import ops
from fusible.testing import exact_parameters_, exact_tensor, stage_names

CASES = {  # name -> (ops for in_place, the stage expected)
    "AddExtraInput": (lambda ip: [ops.AddExtraInput(in_place=ip)], "AddExtraInput"),
    "ForwardLinearBiasAdd": (lambda ip: [ops.Linear(16, 16), ops.AddExtraInput(in_place=ip)],
                             "ForwardLinearBiasAdd"),
    "ForwardLinearScaleAdd": (lambda ip: [ops.BasicLinear(16, 16), ops.ConstantScale(0.5),
                                          ops.AddExtraInput(in_place=ip)],
                              "ForwardLinearScaleAdd"),
    "BackwardLinearAdd": (lambda ip: [ops.MakeExtraOutput(in_place=ip), ops.BasicLinear(16, 16)],
                          "BackwardLinearAdd"),
    "MakeExtraOutput": (lambda ip: [ops.MakeExtraOutput(in_place=ip), ops.GELU()],
                        "MakeExtraOutput"),
}


def _step(name: str, in_place: bool, backend=None, fp8: bool = False):
    """One fwd+bwd of the case on exact values: (outputs and gradients, the residual after
    the call, whether the output shares the residual's storage, the model)."""
    torch.manual_seed(0)
    make, _ = CASES[name]
    model = exact_parameters_(ops.Sequential(*make(in_place)))
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    x = exact_tensor((2, 8, 16)).requires_grad_()
    r = exact_tensor((2, 8, 16)).requires_grad_()
    residual = r * 1.0  # not a leaf: written in place
    dy, d_branch = exact_tensor((2, 8, 16)), exact_tensor((2, 8, 16))
    d_branch_given = d_branch.clone()
    with fusible.autocast() if fp8 else contextlib.nullcontext():
        if name.startswith("Forward") or name == "AddExtraInput":
            y = run(x, residual)
            y.backward(dy)
            branch = None
        else:
            y, branch = run(x)
            torch.autograd.backward([y, branch], [dy, d_branch])
    grads = [x.grad, r.grad] + [p.grad for p in model.parameters()]
    shares = branch is None and y.untyped_storage().data_ptr() == \
        residual.untyped_storage().data_ptr()
    return [y.detach()] + grads, residual.detach(), shares, model, (d_branch, d_branch_given)


@pytest.mark.parametrize("name", list(CASES))
def test_in_place_same_values_and_gradients(name):
    """In place (eager): the bits of out of place, the expected stage chosen, and the sum
    written where TransformerEngine writes it."""
    plain = _step(name, False)
    ours, residual, shares, model, d_branch = _step(name, True)
    for a, b in zip(plain[0], ours):
        assert (a is None and b is None) or torch.equal(a, b)
    x = exact_tensor((2, 8, 16)).requires_grad_()
    plan = model.plan(x, x) if isinstance(model[-1], ops.AddExtraInput) else model.plan(x)
    assert CASES[name][1] in stage_names(plan.forward + plan.backward)
    if isinstance(model[-1], ops.AddExtraInput):
        assert shares and torch.equal(residual, ours[0])  # the output is the residual
    else:  # autograd's gradient buffers are left alone (they may be shared)
        assert torch.equal(*d_branch)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", ["ForwardLinearBiasAdd", "ForwardLinearScaleAdd",
                                  "BackwardLinearAdd"])
def test_in_place_compiled_same_bits_as_eager(name, backend):
    """Compiled (no graph break) in place gives eager's bits, and the residual is written
    (the output is the graph's own tensor)."""
    torch._dynamo.reset()
    eager, eager_residual, *_ = _step(name, True)
    compiled, residual, *_ = _step(name, True, backend)
    for a, b in zip(eager, compiled):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(residual, eager_residual)


@pytest.mark.parametrize("name", ["ForwardLinearBiasAdd", "BackwardLinearAdd"])
def test_in_place_fp8_same_bits_as_out_of_place(name):
    """Under FP8: the residual written in place, with out of place's bits."""
    plain = _step(name, False, fp8=True)[0]
    ours, residual, shares, _, d_branch = _step(name, True, fp8=True)
    for a, b in zip(plain, ours):
        assert (a is None and b is None) or torch.equal(a, b)
    if name == "ForwardLinearBiasAdd":
        assert shares and torch.equal(residual, ours[0])
    else:
        assert torch.equal(*d_branch)


def test_in_place_without_grad_writes_the_residual():
    model = ops.Sequential(ops.Linear(8, 8), ops.AddExtraInput(in_place=True))
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    want = model[0](x) + r
    with torch.no_grad():
        y = model(x, r)
    assert y is r and torch.allclose(r, want)


def test_in_place_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"AddExtraInput\(in_place=True\) at \[0\].*last op"):
        ops.Sequential(ops.AddExtraInput(in_place=True), ops.GELU())(x, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"AddExtraInput\(in_place=True\) writes into its "
                                         r"extra input, which must be contiguous"):
        ops.Sequential(ops.AddExtraInput(in_place=True))(x, torch.randn(8, 4).t())
    leaf = torch.randn(4, 8, requires_grad=True)
    before = leaf.detach().clone()
    for run in (lambda m: m, lambda m: torch.compile(m, backend="aot_eager", fullgraph=True)):
        with pytest.raises(Exception, match=r"AddExtraInput\(in_place=True\) writes into its "
                                            r"extra input, a leaf tensor that requires grad"):
            run(ops.Sequential(ops.AddExtraInput(in_place=True)))(x, leaf)
    assert torch.equal(leaf.detach(), before)  # refused before writing
    with pytest.raises(TypeError, match="in_place"):
        ops.AddExtraInput(in_place="yes")
    with pytest.raises(TypeError, match="in_place"):
        ops.MakeExtraOutput(in_place=1)
    # a gradient shared by an addition's two operands stays intact (the review's case)
    model = ops.Sequential(ops.MakeExtraOutput(in_place=True), ops.BasicLinear(8, 8))
    x, r = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    y, branch = model(x)
    ((y + r) * 3 + branch).sum().backward()
    twin = ops.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(8, 8))
    twin.load_state_dict(model.state_dict())
    x2 = x.detach().clone().requires_grad_()
    y2, branch2 = twin(x2)
    ((y2 + r) * 3 + branch2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(model[1].weight.grad, twin[1].weight.grad)
    model = ops.Sequential(ops.Linear(8, 8), ops.AddExtraInput(in_place=True))
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(TypeError, match="autocast dtype torch.bfloat16"):
        model(x, torch.randn(4, 8))
    assert "in_place=True" in repr(model) and "in_place=True" in model.plan(x, x).explain()
