"""accumulate_into_main_grad: Megatron-style float32 main_grad buffers that linear layers'
weight gradients are added into, eager and compiled, through every stage that computes a
linear layer's wgrad."""

import pytest
import torch

import fusible
from fusible import ops
from fusible.testing import exact_parameters_, exact_tensor, stage_names

DTYPE = torch.bfloat16


def _models():
    """(model, the linear op whose weight accumulates, the backward stage expected)."""
    linear = ops.Linear(16, 24, accumulate_into_main_grad=True)
    basic = ops.BasicLinear(16, 24, accumulate_into_main_grad=True)
    branch = ops.BasicLinear(16, 24, accumulate_into_main_grad=True)
    scaled = ops.BasicLinear(16, 24, accumulate_into_main_grad=True)
    return {"BackwardLinearBias": (ops.Sequential(linear), linear),
            "BasicLinear": (ops.Sequential(basic), basic),
            "BackwardLinearAdd": (ops.Sequential(ops.MakeExtraOutput(), branch), branch),
            "BackwardLinearScale": (ops.Sequential(scaled, ops.ConstantScale(0.5)), scaled)}


def _microbatches(model, steps: int = 2, run=None):
    """Forward ``steps`` exact microbatches, then their backwards in reverse order (as a
    pipeline schedule does); returns the fp64 sum of the weight gradients."""
    run = run or model
    torch.manual_seed(0)
    want, outputs = 0, []
    for _ in range(steps):
        x = exact_tensor((3, 5, 16), DTYPE).requires_grad_()
        dy = exact_tensor((3, 5, 24), DTYPE)
        out = run(x)
        y = out[0] if isinstance(out, tuple) else out
        scale = 0.5 if isinstance(model[-1], ops.ConstantScale) else 1.0
        want = want + scale * dy.double().reshape(-1, 24).t() @ x.double().reshape(-1, 16)
        outputs.append((y, dy))
    for y, dy in reversed(outputs):
        y.backward(dy)
    return want


@pytest.mark.parametrize("stage", list(_models()))
def test_weight_gradient_accumulates_in_float32_into_main_grad(stage):
    """Through each stage that computes a linear layer's wgrad: main_grad holds the fp64
    sum of the microbatches' gradients exactly (a 16-bit gradient added in would be
    rounded), the weight's .grad stays None, and other parameters get theirs."""
    model, linear = _models()[stage]
    exact_parameters_(model.to(DTYPE))
    linear.weight.main_grad = torch.zeros_like(linear.weight, dtype=torch.float32)
    x = exact_tensor((3, 5, 16), DTYPE, bits=0).requires_grad_()
    assert stage in stage_names(model.plan(x).backward)
    want = _microbatches(model)
    assert torch.equal(linear.weight.main_grad.double(), want)
    assert linear.weight.grad is None
    if stage == "BackwardLinearBias":
        assert linear.bias.grad is not None and linear.bias.grad.dtype == DTYPE


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_main_grad_compiled_same_bits_as_eager(backend):
    """Compiled (no graph break), the buffers get the same bits as eager, and the input
    gradient too."""
    torch._dynamo.reset()
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = ops.Sequential(ops.LayerNorm(16), ops.Linear(16, 32, accumulate_into_main_grad=True),
                               ops.GELU(), ops.Linear(32, 24, accumulate_into_main_grad=True))
        exact_parameters_(model.to(DTYPE))
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        for _ in range(2):
            x = exact_tensor((6, 16), DTYPE).requires_grad_()
            run(x).backward(exact_tensor((6, 24), DTYPE))
        grads.append([x.grad] + [p.main_grad.clone() for p in model.parameters()]
                     + [p.grad for p in model.parameters()])
    eager, compiled = grads
    for a, b in zip(eager, compiled):
        assert (a is None and b is None) or torch.equal(a, b)
    assert [g is None for g in eager[-6:]] == [False, False, True, False, True, False]


def test_fp8_weight_gradient_into_main_grad():
    """Under FP8 the wgrad GEMM writes float32: one step's main_grad rounds to the bf16
    gradient the same model computes without main_grad."""
    grads = []
    for main in (True, False):
        torch.manual_seed(0)
        model = ops.Sequential(ops.Linear(32, 48, accumulate_into_main_grad=main)).to(DTYPE)
        weight = model[0].weight
        if main:
            weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
        x = torch.randn(64, 32, dtype=DTYPE)
        with fusible.autocast():
            model(x).backward(torch.randn(64, 48, dtype=DTYPE))
        grads.append(weight.main_grad if main else weight.grad)
    assert grads[0].dtype == torch.float32
    assert torch.equal(grads[0].to(DTYPE), grads[1])


def test_megatron_flag_gets_a_dummy_gradient():
    """A weight with Megatron DDP's grad_added_to_main_grad has it set and gets a dummy
    gradient for DDP's hooks: zeros with zero_out_wgrad."""
    model = ops.Sequential(ops.BasicLinear(8, 8, accumulate_into_main_grad=True))
    weight = model[0].weight
    weight.main_grad = torch.zeros(8, 8)
    weight.grad_added_to_main_grad, weight.zero_out_wgrad = False, True
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert weight.grad_added_to_main_grad is True
    assert torch.equal(weight.grad, torch.zeros(8, 8))
    assert torch.allclose(weight.main_grad, torch.ones(4, 8).t() @ x)


def test_main_grad_errors_name_the_op():
    model = ops.Sequential(ops.BasicLinear(8, 8, accumulate_into_main_grad=True))
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"BasicLinear\(in_features=8.*main_grad.*lacks"):
        model(x)
    model[0].weight.main_grad = torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match=r"shape \(8, 8\).*got torch.float32 of shape \(8, 4\)"):
        model(x)
    with torch.no_grad():  # no gradient, no buffer needed
        model(x)
    model[0].weight.requires_grad_(False)
    model(x)
    model[0].weight.requires_grad_(True)
    model[0].weight.main_grad = torch.zeros(8, 8)
    model[0].weight.grad_added_to_main_grad = False
    torch._dynamo.reset()
    with pytest.raises(Exception, match="grad_added_to_main_grad.*run this model eagerly"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    with pytest.raises(TypeError, match="accumulate_into_main_grad"):
        ops.BasicLinear(8, 8, accumulate_into_main_grad=1)


def test_switching_main_grad_off_replans():
    model = ops.Sequential(ops.Linear(8, 8, accumulate_into_main_grad=True))
    model[0].weight.main_grad = torch.zeros(8, 8)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert model[0].weight.grad is None and model[0].weight.main_grad.abs().sum() > 0
    model[0].accumulate_into_main_grad = False
    model(x).sum().backward()
    assert model[0].weight.grad is not None
    assert "accumulate_into_main_grad" not in repr(model)
