"""GroupedLinear under FP8: grouped FP8 GEMMs against an FP64 emulation of their
quantization (the tokens per tensor, each group's weight by its own scale, E4M3
throughout), compiled bit for bit, the alignment the weight gradient needs."""

import pytest
import torch

import fusible
from fusible import moe, ops
from fusible.testing import snr_db
from fp8_emulation import assert_snrs_above, quantize_dequantize

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
E4M3 = torch.float8_e4m3fn
SPLITS = (16, 0, 32, 16)  # an empty expert; every count a multiple of 16


def _quantized(t):
    """``t`` quantized and dequantized (E4M3, per tensor); the gradient passes as it is."""
    return t + (quantize_dequantize(t, E4M3) - t).detach()


def _per_group(w):
    return torch.stack([_quantized(wg) for wg in w])


class _QuantizedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return quantize_dequantize(g, E4M3)


def _grouped_reference(x, w, splits):
    """FP64 ``y[group g] = q(x)[group g] @ q_g(w[g]).T``, ``dy`` quantized on the way
    back (per tensor, E4M3)."""
    xq, wq = _quantized(x), _per_group(w)
    rows, start = [], 0
    for g, size in enumerate(splits):
        rows.append(xq[start:start + size] @ wq[g].t())
        start += size
    return _QuantizedGrad.apply(torch.cat(rows))


def _experts(groups, sizes, scales):
    """GroupedLinear ops (float32) whose groups' weights differ by the factors
    ``scales``: one scale for all of them would lose the small ones' precision."""
    torch.manual_seed(0)
    layers = [ops.GroupedLinear(groups, n_in, n_out) for n_in, n_out in sizes]
    with torch.no_grad():
        for layer in layers:
            layer.weight.mul_(torch.tensor(scales).view(-1, 1, 1))
    return layers


def _results(model, x, *extras):
    y = model(x, *extras)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    out = [y, x.grad] + [p.grad for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    return out


def test_fp8_against_an_fp64_emulation_per_group_weight_scales():
    (layer,) = _experts(4, [(32, 48)], [1.0, 2.0 ** -6, 8.0, 2.0 ** -3])
    model = ops.Sequential(layer)
    x = torch.randn(64, 32, requires_grad=True)
    splits = torch.tensor(SPLITS)
    with fusible.autocast():
        y, dx, dw = _results(model, x, splits)
    xr = x.detach().double().requires_grad_()
    wr = layer.weight.detach().double().requires_grad_()
    yr = _grouped_reference(xr, wr, SPLITS)
    yr.backward(torch.linspace(-1, 1, yr.numel()).view_as(yr).double())
    # the same FP8 operands: only float32 accumulation and rounding differ (a per-tensor
    # weight scale instead reaches about 30 dB)
    assert_snrs_above({"y": snr_db(y, yr), "dx": snr_db(dx, xr.grad),
                       "dw": snr_db(dw, wr.grad)}, 100, "GroupedLinear FP8")
    assert not dw[1].any()  # the expert without tokens


def test_fp8_swiglu_experts_hand_over_fp8_and_compile_bit_for_bit():
    w13, w2 = _experts(4, [(32, 64), (32, 32)], [1.0, 4.0, 2.0 ** -4, 0.5])
    model = ops.Sequential(w13, ops.SwiGLU(), w2)
    x = torch.randn(64, 32, requires_grad=True)
    splits = torch.tensor(SPLITS)
    with fusible.autocast():
        eager = _results(model, x, splits, splits)
        compiled = _results(torch.compile(model, fullgraph=True, backend="aot_eager"), x,
                            splits, splits)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    # the chain in FP64 with the same quantization points
    xr = x.detach().double().requires_grad_()
    w1 = w13.weight.detach().double().requires_grad_()
    w2r = w2.weight.detach().double().requires_grad_()
    a, b = _grouped_reference(xr, w1, SPLITS).chunk(2, -1)
    yr = _grouped_reference(torch.nn.functional.silu(a) * b, w2r, SPLITS)
    yr.backward(torch.linspace(-1, 1, yr.numel()).view_as(yr).double())
    snrs = {name: snr_db(got, want) for name, got, want in
            [("y", eager[0], yr), ("dx", eager[1], xr.grad), ("dw13", eager[2], w1.grad),
             ("dw2", eager[3], w2r.grad)]}
    assert_snrs_above(snrs, 45, "FP8 SwiGLU experts")  # an E4M3 rounding flips here and there


def test_fp8_tensors_handed_between_the_stages():
    """SwiGLU hands the second GroupedLinear its input in E4M3, and the first its
    gradient in E4M3 (not the recipe's E5M2) with the transposed copy wgrad reads."""
    from fusible.runtime import custom_ops
    w13, w2 = _experts(4, [(32, 64), (32, 32)], [1.0] * 4)
    model = ops.Sequential(w13, ops.SwiGLU(), w2)
    splits = torch.tensor(SPLITS)
    custom_ops.recorder = []
    try:
        with fusible.autocast():
            compiled = torch.compile(model, fullgraph=True, backend="eager")  # real custom ops
            compiled(torch.randn(64, 32, requires_grad=True), splits, splits).sum().backward()
        calls = [(str(op).split(".")[1], custom_ops.stage_op_named(str(op).split(".")[1])
                  .expand(args)) for op, args in custom_ops.recorder
                 if not isinstance(args[0], torch._subclasses.FakeTensor)]
    finally:
        custom_ops.recorder = None
    second_fwd = [a for name, a in calls if name == "GroupedLinear_fwd"][1]
    data, scale_inv, transpose = second_fwd[:3]  # its input, as a Float8Tensor
    assert data.dtype == E4M3 and scale_inv.dim() == 0 and transpose is not None
    first_bwd = [a for name, a in calls if name == "GroupedLinear_bwd"][1]
    data, scale_inv, transpose = first_bwd[:3]  # its incoming gradient
    assert data.dtype == E4M3 and scale_inv.dim() == 0 and transpose is not None


def test_fp8_weight_read_once_per_step(monkeypatch):
    """Each weight is cast once a step: the forward's cast writes the transposed copy that
    dgrad reads (not where no dgrad follows: the first layer of an input without a
    gradient), and the backward casts no weight."""
    from fusible.ops import grouped_linear
    casts = []
    real = grouped_linear.cast_grouped_weight
    monkeypatch.setattr(grouped_linear, "cast_grouped_weight", lambda w, *a, **k: casts.append(
        (w.shape[1], k.get("columnwise", False))) or real(w, *a, **k))
    w13, w2 = _experts(4, [(32, 64), (32, 32)], [1.0] * 4)
    model = ops.Sequential(w13, ops.SwiGLU(), w2)
    splits = torch.tensor(SPLITS)
    for needs_dx, want in ((True, [(64, True), (32, True)]), (False, [(64, False), (32, True)])):
        casts.clear()
        with fusible.autocast():
            y = model(torch.randn(64, 32, requires_grad=needs_dx), splits, splits)
            assert casts == want
            y.sum().backward()
        assert casts == want


def test_fp8_weight_gradient_needs_aligned_groups_and_says_how():
    model = ops.Sequential(ops.GroupedLinear(2, 32, 32))
    x = torch.randn(32, 32, requires_grad=True)
    with fusible.autocast():
        y = model(x, torch.tensor([5, 27]))
        with pytest.raises(RuntimeError, match=r"GroupedLinear under FP8.*multiple of 16.*"
                                               r"align=16"):
            y.sum().backward()
        x2 = x.detach()  # no weight gradient: any sizes
        model.requires_grad_(False)
        assert model(x2.requires_grad_(), torch.tensor([5, 27])).shape == (32, 32)


def test_fp8_needs_feature_sizes_divisible_by_16():
    model = ops.Sequential(ops.GroupedLinear(2, 24, 32))
    with fusible.autocast(), pytest.raises(ValueError, match=r"GroupedLinear\(num_groups=2, "
                                                             r"in_features=24.*divisible by 16"):
        model(torch.randn(16, 24), torch.tensor([8, 8]))


def test_fp8_moe_layer_with_aligned_routing_trains_like_bf16():
    torch.manual_seed(0)
    w13, w2 = _experts(8, [(32, 64), (32, 32)], [1.0] * 8)
    experts = ops.Sequential(w13, ops.SwiGLU(), w2)
    x = torch.randn(100, 32, requires_grad=True)
    logits = torch.randn(100, 8)
    chosen, weights = moe.route_top_k(logits, 2)

    def layer():
        rows, routing = moe.permute_tokens(x, chosen, 8, align=16)
        return moe.unpermute_tokens(experts(rows, routing.splits, routing.splits), routing,
                                    weights)
    results = []
    for fp8 in (False, True):
        with fusible.autocast(enabled=fp8):
            y = layer()
        y.backward(torch.ones_like(y))
        results.append([y, x.grad, w13.weight.grad, w2.weight.grad])
        x.grad = w13.weight.grad = w2.weight.grad = None
    # FP8 (E4M3) against float32 through two layers: about 24 dB
    for got, want in zip(results[1], results[0]):
        assert snr_db(got, want) > 20
