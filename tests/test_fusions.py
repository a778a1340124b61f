"""Every built-in fusion: the plan chooses it, and it matches the FP64 reference."""

import pytest
import torch

from fusible import ops
from fusible.testing import check_fusion, exact_parameters_, exact_tensor, stage_names


def _prepare(model, dtype):
    return exact_parameters_(model.to(dtype))


@pytest.mark.parametrize("lead", [(4,), (2, 3)], ids=["2d", "3d"])
def test_forward_linear_bias(dtype, lead):
    model = _prepare(ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10)), dtype)
    x = exact_tensor((*lead, 6), dtype).requires_grad_()
    check_fusion(model, x, forward=["ForwardLinearBias"], backward=["BackwardLinearBias"])
    assert stage_names(model.plan(x).backward) == ["BackwardLinearBias"]


def test_backward_linear_bias_frozen_weight_and_input(dtype):
    """Only dbias is needed: the fusion still runs, computing neither dgrad nor wgrad."""
    model = _prepare(ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10)), dtype)
    model[0].weight.requires_grad_(False)
    x = exact_tensor((4, 6), dtype)
    check_fusion(model, x, backward=["BackwardLinearBias"])


def test_backward_linear_bias_refused_for_frozen_bias():
    model = ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10))
    model[1].bias.requires_grad_(False)
    plan = model.plan()
    assert stage_names(plan.backward) == ["Bias", "BasicLinear"]
    (cand,) = [c for c in plan.candidates if c.fusion == "BackwardLinearBias"]
    assert cand.status == "refused" and "needs no gradient" in cand.reason


def test_forward_linear_bias_relu_in_training(dtype):
    model = _prepare(ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10), ops.ReLU(),
                                    ops.BasicLinear(10, 3)), dtype)
    x = exact_tensor((2, 4, 6), dtype).requires_grad_()
    check_fusion(model, x, forward=["ForwardLinearBiasActivation"],
                 backward=["BackwardActivationBias"])


def test_forward_linear_bias_gelu_inference(dtype):
    """CPU's epilogue is exact GELU, and inference needs no pre-activation."""
    model = _prepare(ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10), ops.GELU()), dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    x = exact_tensor((3, 6), dtype)
    with torch.no_grad():
        assert stage_names(model.plan(x).forward) == ["ForwardLinearBiasActivation"]
        check_fusion(model, x, forward=["ForwardLinearBiasActivation"])


def test_forward_linear_bias_gelu_refused_in_training():
    model = ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10), ops.GELU())
    plan = model.plan()
    assert stage_names(plan.forward) == ["ForwardLinearBias", "GELU"]
    refused = [c for c in plan.candidates if c.fusion == "ForwardLinearBiasActivation"]
    assert refused[0].status == "refused" and "pre-activation" in refused[0].reason


@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_linear_bias_add(dtype, with_bias):
    layers = [ops.BasicLinear(6, 6)] + ([ops.Bias(6)] if with_bias else []) + [ops.AddExtraInput()]
    model = _prepare(ops.Sequential(*layers), dtype)
    x = exact_tensor((2, 3, 6), dtype).requires_grad_()
    residual = exact_tensor((2, 3, 6), dtype).requires_grad_()
    check_fusion(model, x, residual, forward=["ForwardLinearBiasAdd"])
    assert model.plan(x, residual).forward[0].indices == tuple(range(len(layers)))


@pytest.mark.parametrize("act", [ops.GELU, lambda: ops.GELU(approximate="tanh"), ops.ReLU,
                                 ops.SiLU], ids=["gelu", "gelu_tanh", "relu", "silu"])
def test_backward_activation_bias(dtype, act):
    model = _prepare(ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10), act(),
                                    ops.BasicLinear(10, 4)), dtype)
    x = exact_tensor((5, 6), dtype).requires_grad_()
    check_fusion(model, x, backward=["BackwardActivationBias"])


def test_backward_activation_bias_refused_for_frozen_bias():
    model = ops.Sequential(ops.BasicLinear(6, 10), ops.Bias(10), ops.GELU())
    model[1].bias.requires_grad_(False)
    plan = model.plan()
    assert "BackwardActivationBias" not in stage_names(plan.backward)
    reasons = [c.reason for c in plan.candidates if c.fusion == "BackwardActivationBias"]
    assert reasons and "needs no gradient" in reasons[0]


def test_backward_linear_add(dtype):
    model = _prepare(ops.Sequential(ops.LayerNorm(6), ops.MakeExtraOutput(), ops.BasicLinear(6, 8),
                                    ops.GELU()), dtype)
    x = exact_tensor((3, 6), dtype).requires_grad_()
    check_fusion(model, x, backward=["BackwardLinearAdd"])
    assert [s.indices for s in model.plan(x).backward] == [(3,), (1, 2), (0,)]


def test_backward_linear_add_refused_without_dgrad():
    model = ops.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(6, 8))
    plan = model.plan(torch.randn(2, 6))
    assert stage_names(plan.backward) == ["BasicLinear"]  # MakeExtraOutput's backward never runs
    assert any(c.fusion == "BackwardLinearAdd" and c.status == "refused" for c in plan.candidates)


def test_transformer_mlp_block(dtype):
    """Residual MLP block: several fusions in one plan, forward and backward."""
    model = _prepare(ops.Sequential(
        ops.MakeExtraOutput(), ops.LayerNorm(8), ops.Linear(8, 16), ops.GELU(approximate="tanh"),
        ops.Linear(16, 8), ops.AddExtraInput()), dtype)
    x = exact_tensor((2, 3, 8), dtype).requires_grad_()
    residual = exact_tensor((2, 3, 8), dtype).requires_grad_()
    # Six ops in a row: 16-bit rounding of every intermediate adds up (see assert_close).
    check_fusion(model, x, residual, forward=["ForwardLinearBias", "ForwardLinearBiasAdd"],
                 backward=["BackwardActivationBias"], tolerance_scale=4)


def test_forward_linear_scale_add_and_backward_linear_scale(dtype):
    model = _prepare(ops.Sequential(ops.BasicLinear(6, 6), ops.ConstantScale(-0.25),
                                    ops.AddExtraInput()), dtype)
    x = exact_tensor((2, 3, 6), dtype).requires_grad_()
    residual = exact_tensor((2, 3, 6), dtype).requires_grad_()
    check_fusion(model, x, residual, forward=["ForwardLinearScaleAdd"],
                 backward=["BackwardLinearScale"])
    assert [s.indices for s in model.plan(x, residual).backward] == [(2,), (0, 1)]


def test_linear_scale_fusions_round_once():
    """Fused, the scale is the GEMMs' alpha and the residual their C matrix: each result
    is one GEMM's rounding of the exact value (the unfused ops round two or three times)."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    model = ops.Sequential(ops.BasicLinear(64, 48), ops.ConstantScale(0.3),
                           ops.AddExtraInput()).to(bf16)
    x = torch.randn(40, 64, dtype=bf16, requires_grad=True)
    residual = torch.randn(40, 48, dtype=bf16)
    dy = torch.randn(40, 48, dtype=bf16)
    y = model(x, residual)
    y.backward(dy)
    w = model[0].weight
    assert torch.equal(y, torch.addmm(residual, x.detach(), w.detach().t(), alpha=0.3))
    zero = dy.new_zeros(())
    assert torch.equal(x.grad, torch.addmm(zero, dy, w.detach(), beta=0, alpha=0.3))
    assert torch.equal(w.grad, torch.addmm(zero, dy.t(), x.detach(), beta=0, alpha=0.3))


def test_backward_add_rms_norm(dtype):
    model = _prepare(ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(6),
                                    ops.BasicLinear(6, 8)), dtype)
    x = exact_tensor((3, 6), dtype).requires_grad_()
    check_fusion(model, x, backward=["BackwardAddRMSNorm"])
    assert [s.indices for s in model.plan(x).backward] == [(2,), (0, 1)]


def test_backward_add_rms_norm_rounds_once_and_is_refused_without_dgrad():
    """The branch's gradient joins RMSNorm's dx in float32, before dx's one rounding."""
    from fusible.functional.norms import rms_norm_backward
    torch.manual_seed(0)
    model = ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(24)).to(torch.bfloat16)
    x = torch.randn(5, 24, dtype=torch.bfloat16, requires_grad=True)
    dy, d_branch = torch.randn(2, 5, 24, dtype=torch.bfloat16)
    y, branch = model(x)
    torch.autograd.backward([y, branch], [dy, d_branch])
    rstd = torch.rsqrt(x.detach().float().square().mean(-1, keepdim=True) + model[1].eps)
    dx32, _ = rms_norm_backward(dy.float(), x.detach().float(), rstd, model[1].weight.float(),
                                [24], True, False)
    assert torch.equal(x.grad, (dx32 + d_branch.float()).to(torch.bfloat16))
    frozen = ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(24))
    plan = frozen.plan(torch.randn(5, 24))
    assert "BackwardAddRMSNorm" not in stage_names(plan.backward)
