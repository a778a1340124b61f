"""The row-wise recipe (Float8RowwiseScaling) on linear layers: each GEMM against FP64 on
the same row-wise quantized operands, more accurate than one scale per tensor where rows
differ in magnitude, compiled bit for bit."""

import pytest
import torch

import fusible
from fusible import ops
from fusible.quantization.cast import cast_to_fp8_rowwise
from fusible.testing import snr_db

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
E4M3 = torch.float8_e4m3fn
ROWWISE = fusible.Float8RowwiseScaling()


def _rows(t):
    """``t`` (2-D) quantized per row and dequantized, float64."""
    data, scale_inv, _, _ = cast_to_fp8_rowwise(t, E4M3)
    return data.double() * scale_inv.double()


def _outlier_rows(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 2.0 ** torch.randint(-8, 9, (rows, 1), generator=gen)
    return torch.randn(rows, cols, generator=gen) * magnitudes


def _linear_step(recipe, x, w, dy):
    layer = ops.Sequential(ops.BasicLinear(w.shape[1], w.shape[0]))
    with torch.no_grad():
        layer[0].weight.copy_(w)
    xx = x.clone().requires_grad_()
    with fusible.autocast(recipe=recipe):
        y = layer(xx)
    y.backward(dy)
    return y.detach(), xx.grad, layer[0].weight.grad


def test_each_gemm_reads_row_wise_operands():
    """forward ``q(x) @ q(W).T``, dgrad ``q(dy) @ q'(W)`` with W's copy per input feature,
    wgrad ``q'(dy).T @ q'(x)`` with the copies per feature: the same values as FP64 on those
    operands up to float32 accumulation."""
    x, w, dy = _outlier_rows(48, 64, 0), _outlier_rows(32, 64, 1), _outlier_rows(48, 32, 2)
    y, dx, dw = _linear_step(ROWWISE, x, w, dy)
    assert snr_db(y, _rows(x) @ _rows(w).t()) > 60
    assert snr_db(dx, _rows(dy) @ _rows(w.t().contiguous()).t()) > 60
    assert snr_db(dw, _rows(dy.t().contiguous()) @ _rows(x.t().contiguous()).t()) > 60


def test_row_wise_beats_per_tensor_scaling_on_outlier_rows():
    """Rows 2^-8 to 2^8 apart: one scale per tensor leaves the small rows to E4M3's
    subnormals; one per row keeps every row at E4M3's precision."""
    x, w, dy = _outlier_rows(64, 128, 3), torch.randn(96, 128), _outlier_rows(64, 96, 4)
    want_y = x.double() @ w.double().t()
    want_dx = dy.double() @ w.double()
    got = {name: _linear_step(recipe, x, w, dy) for name, recipe in
           (("rowwise", ROWWISE), ("tensorwise", fusible.Float8CurrentScaling("e4m3")))}
    small_x, small_dy = x.abs().amax(1) < 2.0 ** -5, dy.abs().amax(1) < 2.0 ** -5
    snr = {name: (snr_db(y[small_x], want_y[small_x]), snr_db(dx[small_dy], want_dx[small_dy]))
           for name, (y, dx, _) in got.items()}  # about 29 / 29 against 15 / 19 here
    assert snr["rowwise"][0] > 25 and snr["rowwise"][0] > snr["tensorwise"][0] + 8, snr
    assert snr["rowwise"][1] > 25 and snr["rowwise"][1] > snr["tensorwise"][1] + 8, snr


def test_row_wise_mlp_compiles_bit_for_bit():
    """RMSNorm, linear + bias + GELU, linear: the stages hand row-wise FP8 tensors across
    their custom ops (each scale tensor and the copies' own), eager and compiled alike."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.RMSNorm(64), ops.Linear(64, 128), ops.GELU(),
                           ops.Linear(128, 64))
    x = _outlier_rows(48, 64, 5)

    def step(m):
        xx = x.clone().requires_grad_()
        with fusible.autocast(recipe=ROWWISE):
            y = m(xx)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        out = [y.detach(), xx.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    eager = step(model)
    compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    with torch.no_grad():
        ref = model(x)
    assert snr_db(eager[0], ref) > 20


def test_rowwise_recipe_presets_and_formats():
    assert fusible.recipe_from_name("rowwise") == ROWWISE
    assert fusible.recipe_from_name("rowwise_hybrid").grad_format().fp8_dtype == \
        torch.float8_e5m2
    fmt = ROWWISE.input_format(columnwise=True)
    assert fmt.granularity == "rowwise" and fmt.columnwise and not fmt.kernel_cast
    with pytest.raises(ValueError, match="fp8_format must be one of"):
        fusible.Float8RowwiseScaling("e5m2")


def test_what_rowwise_does_not_take_yet_says_so():
    with pytest.raises(NotImplementedError, match="FP8 parameters hold one scale per tensor"):
        with fusible.quantized_model_init(recipe=ROWWISE):
            pass


def test_a_row_wise_input_handed_over_is_used_as_it_is():
    """``Quantize`` before a linear layer hands it a row-wise Float8Tensor without the
    transposed copy: the forward reads it as it is (the output of the layer quantizing
    its input itself, up to float32 rounding), wgrad's copy is quantized per feature from
    those FP8 values (twice rounded, close); eager and compiled alike."""
    torch.manual_seed(0)
    plain = ops.Sequential(ops.Linear(64, 32))
    handed = ops.Sequential(ops.Quantize(), ops.Linear(64, 32))
    with torch.no_grad():
        handed[1].weight.copy_(plain[0].weight)
        handed[1].bias.copy_(plain[0].bias)
    x = _outlier_rows(32, 64, 6)

    def step(m):
        xx = x.clone().requires_grad_()
        with fusible.autocast(recipe=ROWWISE):
            y = m(xx)
        y.backward(torch.ones_like(y))
        out = [y.detach(), xx.grad] + [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return out

    want, got = step(plain), step(handed)
    assert snr_db(got[0], want[0]) > 120 and snr_db(got[2], want[2]) > 20
    compiled = step(torch.compile(handed, fullgraph=True, backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(compiled, got))
