"""Scaled gated units: the router's per-token weights applied inside the expert (the test
matrix runs each one's example against FP64, compiled, through opcheck and under FP8)."""

import pytest
import torch

from fusible import moe, ops
from fusible.testing import exact_tensor

UNITS = [(ops.ScaledSwiGLU, ops.SwiGLU, {}), (ops.ScaledGEGLU, ops.GEGLU, {}),
         (ops.ScaledClampedSwiGLU, ops.ClampedSwiGLU, {"limit": 1.0}),
         (ops.ScaledSiTUGLU, ops.SiTUGLU, {"glu_interleave_size": 2})]


@pytest.mark.parametrize("scaled,plain,options", UNITS, ids=[u[0].__name__ for u in UNITS])
def test_the_unit_times_the_scales_with_both_gradients(scaled, plain, options):
    x = exact_tensor((2, 5, 16), torch.float64).requires_grad_()
    s = exact_tensor((2, 5), torch.float64).requires_grad_()
    y = ops.Sequential(scaled(**options))(x, s)
    x_ref, s_ref = (t.detach().clone().requires_grad_() for t in (x, s))
    want = ops.Sequential(plain(**options))(x_ref) * s_ref.unsqueeze(-1)
    torch.testing.assert_close(y, want)
    dy = exact_tensor(y.shape, torch.float64)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(s.grad, s_ref.grad)


def test_bad_scales_and_options_are_errors_naming_the_unit():
    model = ops.Sequential(ops.ScaledSwiGLU())
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"ScaledSwiGLU\(\) takes one scale per row: scales "
                                         r"of shape \(4,\), got \(4, 1\)"):
        model(x, torch.ones(4, 1))
    with pytest.raises(TypeError, match="scales of dtype torch.float64"):
        model(x, torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="cache_quantized_input is not available"):
        ops.ScaledSwiGLU(cache_quantized_input=True)


def test_a_moe_layer_with_the_weights_inside_the_experts():
    """Scaling inside the experts (ScaledSwiGLU, copies summed) equals combining their
    outputs with the weights."""
    torch.manual_seed(0)
    tokens, hidden, ffn, num_experts, k = 24, 16, 32, 4, 2
    router = torch.nn.Linear(hidden, num_experts, bias=False).double()
    w13 = ops.GroupedLinear(num_experts, hidden, 2 * ffn).double()
    w2 = ops.GroupedLinear(num_experts, ffn, hidden).double()
    outer = ops.Sequential(w13, ops.SwiGLU(), w2)
    inner = ops.Sequential(w13, ops.ScaledSwiGLU(), w2)
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    experts, weights = moe.route_top_k(router(x), k)
    copies, routing = moe.permute_tokens(x, experts, num_experts)
    want = moe.unpermute_tokens(outer(copies, routing.splits, routing.splits), routing,
                                weights)
    scales = moe.sorted_weights(weights, routing)
    got = moe.unpermute_tokens(inner(copies, routing.splits, scales, routing.splits), routing)
    torch.testing.assert_close(got, want)


def test_a_scaled_unit_is_not_its_plain_unit_for_fusion_patterns():
    """A pattern written for SwiGLU (isinstance) must not match ScaledSwiGLU, whose scales
    it would drop."""
    assert not isinstance(ops.ScaledSwiGLU(), ops.SwiGLU)
    assert not isinstance(ops.ScaledClampedSwiGLU(), ops.ClampedSwiGLU)
    assert not isinstance(ops.ScaledSiTUGLU(), ops.SiTUGLU)
    assert not isinstance(ops.ScaledGEGLU(), ops.GEGLU)
