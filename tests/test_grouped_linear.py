"""GroupedLinear: the experts of a mixture of experts as one op (the matrix of
tests/test_matrix.py runs its example against FP64, compiled and through opcheck too)."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from fusible import ops
from fusible.testing import check_compiled_matches_eager, check_fusion, exact_parameters_
from fusible.testing import exact_tensor

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _experts_loop(linears, x, splits):
    """The torch loop over experts a GroupedLinear replaces."""
    outs, start = [], 0
    for lin, size in zip(linears, splits.tolist()):
        outs.append(lin(x[start:start + size]))
        start += size
    return torch.cat(outs)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("sizes", [(5, 0, 3, 4), (0, 0, 12, 0), (3, 3, 3, 3)],
                         ids=["empty_middle", "one_group", "even"])
def test_against_fp64_with_empty_groups(bias, sizes, dtype):
    model = exact_parameters_(ops.Sequential(ops.GroupedLinear(4, 16, 24, bias=bias))
                              .to(dtype))
    x = exact_tensor((12, 16), dtype).requires_grad_()
    check_fusion(model, x, torch.tensor(sizes), forward=["GroupedLinear"],
                 backward=["GroupedLinear"])
    model(x, torch.tensor(sizes)).sum().backward()
    for g, size in enumerate(sizes):  # an expert without tokens gets a zero gradient
        if size == 0:
            assert not model[0].weight.grad[g].any()
            assert not bias or not model[0].bias.grad[g].any()


def test_same_as_a_loop_over_nn_linear_experts_and_converts_both_ways():
    torch.manual_seed(0)
    experts = nn.ModuleList(nn.Linear(16, 24) for _ in range(3))
    op = ops.GroupedLinear.from_linears(experts)
    model = ops.Sequential(op)
    x = torch.randn(2, 5, 16, requires_grad=True)
    splits = torch.tensor([4, 0, 6])
    y = model(x, splits)
    assert y.shape == (2, 5, 24)
    x_ref = x.detach().clone().requires_grad_()
    want = _experts_loop(experts, x_ref.reshape(-1, 16), splits).reshape(2, 5, 24)
    torch.testing.assert_close(y, want)
    y.backward(torch.ones_like(y))
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(x.grad, x_ref.grad)
    for g, lin in enumerate(experts):
        torch.testing.assert_close(op.weight.grad[g], lin.weight.grad)
        torch.testing.assert_close(op.bias.grad[g], lin.bias.grad)
    back = op.to_linears()
    assert all(torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
               for a, b in zip(back, experts))


def test_compiled_bitwise_and_no_recompilation_when_the_routing_changes():
    torch.manual_seed(0)
    model = ops.Sequential(ops.GroupedLinear(3, 16, 32, bias=True), ops.GELU(),
                           ops.BasicLinear(32, 16))
    x = torch.randn(10, 16, requires_grad=True)
    check_compiled_matches_eager(model, x, torch.tensor([4, 0, 6]))
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for sizes in ([4, 0, 6], [10, 0, 0], [1, 2, 7]):
        compiled(x, torch.tensor(sizes)).sum().backward()
    assert counter.frame_count == 1


def test_bad_split_sizes_are_errors_naming_the_op():
    model = ops.Sequential(ops.GroupedLinear(3, 8, 8))
    x = torch.randn(6, 8)
    with pytest.raises(TypeError, match=r"GroupedLinear\(num_groups=3.* integer tensor "
                                        r"\(int32 or int64\) of shape \(3,\), got "
                                        r"torch.float32"):
        model(x, torch.tensor([2.0, 2.0, 2.0]))
    with pytest.raises(TypeError, match="got torch.int16"):
        model(x, torch.tensor([2, 2, 2], dtype=torch.int16))
    model(x, torch.tensor([2, 2, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"shape \(3,\), got torch.int64 of shape \(2,\)"):
        model(x, torch.tensor([3, 3]))
    with pytest.raises(RuntimeError, match="add up to the 6 tokens"):
        model(x, torch.tensor([3, 3, 1]))
    with pytest.raises(RuntimeError, match="non-negative"):
        model(x, torch.tensor([4, -1, 3]))
    with pytest.raises(ValueError, match="last dimension must be 8"):
        model(torch.randn(6, 4), torch.tensor([2, 2, 2]))


def test_under_torch_autocast_the_sizes_stay_integers():
    model = ops.Sequential(ops.GroupedLinear(2, 16, 16))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x, torch.tensor([3, 5]))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), model(x, torch.tensor([3, 5])), atol=0.05, rtol=0.02)


def _scaled_bias_model(dtype=torch.float32):
    return exact_parameters_(ops.Sequential(
        ops.GroupedLinear(4, 16, 24, bias=True, scale_bias=True)).to(dtype))


@pytest.mark.parametrize("scales_need_grad", [True, False], ids=["dscales", "no_dscales"])
def test_scaled_bias_against_fp64(scales_need_grad, dtype):
    """TransformerEngine's scale_bias: each token's bias row scaled by its own number (a
    routing probability); the gradients of the bias and of the scales against FP64."""
    model = _scaled_bias_model(dtype)
    x = exact_tensor((12, 16), dtype).requires_grad_()
    scales = exact_tensor((12,), dtype).requires_grad_(scales_need_grad)
    sizes = torch.tensor([5, 0, 3, 4])
    check_fusion(model, x, sizes, scales, forward=["GroupedLinear"],
                 backward=["GroupedLinear"])


def test_scaled_bias_follows_its_formula_in_bf16_with_float32_scales():
    """y[i] = x[i] W_g^T + s[i] b_g, dbias[g] = sum_i dy[i] s[i], ds[i] = dy[i] . b_g, with
    float32 routing probabilities scaling a bf16 layer; one rounding of the float32 sum."""
    torch.manual_seed(0)
    op = ops.GroupedLinear(3, 16, 8, bias=True, scale_bias=True).to(torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    scales = torch.rand(2, 5, requires_grad=True)
    sizes = torch.tensor([4, 0, 6])
    y = ops.Sequential(op)(x, sizes, scales)
    group = torch.repeat_interleave(torch.arange(3), sizes)
    w, b = op.weight.double(), op.bias.double()
    s64 = scales.detach().double().reshape(-1, 1)
    x2 = x.reshape(-1, 16).double()
    want = torch.einsum("ti,toi->to", x2, w[group]) + s64 * b[group]
    torch.testing.assert_close(y.reshape(-1, 8).double(), want, atol=0.03, rtol=0.01)
    dy = torch.randn_like(y)
    y.backward(dy)
    dy64 = dy.reshape(-1, 8).double()
    want_db = torch.zeros(3, 8, dtype=torch.float64).index_add_(0, group, dy64 * s64)
    torch.testing.assert_close(op.bias.grad.double(), want_db, atol=0.02, rtol=0.01)
    assert scales.grad.dtype == torch.float32 and scales.grad.shape == (2, 5)
    torch.testing.assert_close(scales.grad.reshape(-1).double(), (dy64 * b[group]).sum(-1),
                               atol=1e-4, rtol=1e-4)


def test_scaled_bias_compiled_bitwise_and_its_errors_name_the_op():
    torch.manual_seed(0)
    model = ops.Sequential(ops.GroupedLinear(3, 16, 32, bias=True, scale_bias=True))
    x = torch.randn(10, 16, requires_grad=True)
    check_compiled_matches_eager(model, x, torch.tensor([4, 0, 6]),
                                 torch.rand(10, requires_grad=True))
    assert "scale_bias=True" in repr(model)
    with pytest.raises(ValueError, match=r"GroupedLinear\(num_groups=2.*scale_bias=True "
                                         r"scales the bias, and there is none"):
        ops.GroupedLinear(2, 8, 8, scale_bias=True)
    with pytest.raises(TypeError, match=r"expects 2 extra input"):
        model(x, torch.tensor([4, 0, 6]))
    with pytest.raises(TypeError, match=r"scale_bias=True\) takes the bias scales as a "
                                        r"floating tensor \(one scale per token\) of shape "
                                        r"\(10,\), got torch.float32 of shape \(10, 1\)"):
        model(x, torch.tensor([4, 0, 6]), torch.rand(10, 1))
    with pytest.raises(TypeError, match=r"got torch.int64 of shape \(10,\)"):
        model(x, torch.tensor([4, 0, 6]), torch.ones(10, dtype=torch.long))


def test_scaled_bias_is_added_in_float32_and_rounded_once():
    """bf16 GEMM outputs that are exact (small integers) plus float32 scales times a
    bf16 bias: y + s * b rounded once, as FP64 rounded to bf16 (rounding s * b first
    would differ on most elements)."""
    torch.manual_seed(0)
    op = ops.GroupedLinear(2, 8, 16, bias=True, scale_bias=True).to(torch.bfloat16)
    with torch.no_grad():
        op.weight.copy_(torch.randint(-2, 3, op.weight.shape))
        op.bias.copy_(torch.randn(op.bias.shape))
    x = torch.randint(-2, 3, (12, 8)).bfloat16()
    scales, sizes = torch.rand(12), torch.tensor([5, 7])
    y = ops.Sequential(op)(x, sizes, scales)
    group = torch.repeat_interleave(torch.arange(2), sizes)
    exact = torch.einsum("ti,toi->to", x.double(), op.weight.double()[group])
    want = (exact + scales.double()[:, None] * op.bias.double()[group]).bfloat16()
    assert (y != want).float().mean() <= 0.01
