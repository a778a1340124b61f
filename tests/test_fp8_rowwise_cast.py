"""The row-wise FP8 cast (issue 16's first building block): each row by its own scale,
the transposed copy per row of its own layout; what it gains over one scale per tensor."""

import pytest
import torch

from fusible.quantization.casts.rowwise import cast_rowwise
from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
from fusible.quantization.tensor.quantize import quantize_rowwise
from fusible.testing import snr_db

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_each_row_is_the_per_tensor_cast_of_that_row(fp8_dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 40) * torch.logspace(-4, 4, 6).view(1, 6, 1)
    data, scale_inv, transpose, t_scale_inv = cast_rowwise(x, fp8_dtype, True, True)
    assert data.shape == x.shape and scale_inv.shape == (12, 1)
    assert transpose.shape == (40, 12) and t_scale_inv.shape == (40, 1)
    rows, cols = x.reshape(12, 40), x.reshape(12, 40).t()
    for i, row in enumerate(rows):
        d, s = cast_tensorwise_torch(row, fp8_dtype)
        assert torch.equal(data.reshape(12, 40)[i].view(torch.uint8), d.view(torch.uint8))
        assert scale_inv[i, 0] == s
    for j, col in enumerate(cols):  # the copy: per feature, not the data transposed
        d, s = cast_tensorwise_torch(col, fp8_dtype)
        assert torch.equal(transpose[j].view(torch.uint8), d.view(torch.uint8))
        assert t_scale_inv[j, 0] == s
    assert scale_inv.max() / scale_inv.min() > 1e6  # the rows' magnitudes, one scale each


def test_special_rows_stay_in_their_row():
    x = torch.randn(5, 16)
    x[1] = 0.0  # scale 1
    x[2] = 1e-38  # the scale stops at the largest float32: finite
    x[3, 4] = float("nan")  # that row NaN, the others not
    data, scale_inv, _, _ = cast_rowwise(x, E4M3)
    assert scale_inv[1, 0] == 1 and not data[1].float().any()
    assert scale_inv[2].isfinite().all() and data[2].float().isfinite().all()
    assert data[3].float().isnan().all() and scale_inv[3].isnan().all()
    kept = [0, 1, 2, 4]
    assert data[kept].float().isfinite().all() and scale_inv[kept].isfinite().all()
    only_t = cast_rowwise(x[[0, 4]], E4M3, rowwise=False, columnwise=True)
    assert only_t[0] is None and only_t[1] is None and only_t[2].shape == (16, 2)
    with pytest.raises(ValueError, match="asked for neither"):
        cast_rowwise(x, E4M3, rowwise=False)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        cast_rowwise(x, torch.bfloat16)
    empty = cast_rowwise(torch.randn(0, 8), E4M3, True, True)
    assert empty[0].shape == (0, 8) and empty[3].shape == (8, 1) and (empty[3] == 1).all()


def test_rows_of_different_magnitudes_keep_their_precision():
    """Per-row outliers (rows 2^-8 to 2^8 apart): one scale per tensor leaves the small
    rows E4M3's subnormals (about 17 dB here), one per row keeps E4M3's precision in each
    (about 32)."""
    torch.manual_seed(0)
    x = torch.randn(64, 128) * (2.0 ** torch.randint(-8, 9, (64, 1))).float()
    data, scale_inv, _, _ = cast_rowwise(x, E4M3)
    per_row = data.float() * scale_inv
    d, s = cast_tensorwise_torch(x, E4M3)
    per_tensor = d.float() * s
    small = x.abs().amax(1) < 2.0 ** -4
    row_snr = snr_db(per_row[small], x[small])
    tensor_snr = snr_db(per_tensor[small], x[small])
    assert row_snr > 28 and row_snr > tensor_snr + 12, (row_snr, tensor_snr)
    assert snr_db(per_row, x) > 28


def _rowwise_pair(columnwise=True):
    torch.manual_seed(0)
    x = torch.randn(24, 64) * (2.0 ** torch.randint(-6, 7, (24, 1))).float()
    w = torch.randn(40, 64) * (2.0 ** torch.randint(-6, 7, (40, 1))).float()
    return x, w, quantize_rowwise(x, E4M3, columnwise), quantize_rowwise(w, E4M3, columnwise)


def test_rowwise_float8_tensor_dequantizes_views_and_transposes():
    x, _, xq, _ = _rowwise_pair()
    assert xq.scale_inv.shape == (24, 1) and xq.transpose_scale_inv.shape == (64, 1)
    assert not xq.per_tensor and snr_db(xq.dequantize(), x) > 28
    xt = xq.t()  # the copy, scaled per feature, becomes the data
    assert xt._data.data_ptr() == xq._transpose.data_ptr() and xt.scale_inv.shape == (64, 1)
    assert snr_db(xt.dequantize(), x.t()) > 28 and xt.t()._data.data_ptr() == xq._data.data_ptr()
    bare = quantize_rowwise(x, E4M3).t()  # no copy: the data seen transposed, column scales
    assert bare.scale_inv.shape == (1, 24)
    assert torch.equal(bare.dequantize(), quantize_rowwise(x, E4M3).dequantize().t())
    three = quantize_rowwise(x.view(4, 6, 64), E4M3)
    assert three.scale_inv.shape == (4, 6, 1)
    flat = three.view(24, 64)  # the rows' scales follow the rows
    assert flat.scale_inv.shape == (24, 1) and torch.equal(flat.dequantize(), xq.dequantize())
    # slices and a new row length dequantize (the scales would need the same indexing)
    assert torch.equal(xq[3:7], xq.dequantize()[3:7])
    assert torch.equal(xq.reshape(48, 32), xq.dequantize().reshape(48, 32))


def test_rowwise_gemm_runs_scaled_mm_with_row_and_column_scales(monkeypatch):
    """x @ w.T: x per token, w per output feature (its rows), one torch._scaled_mm with
    (M, 1) and (1, N) scales; the result that of the dequantized operands. dx = dy @ w
    reads w's copy (scaled per input feature): also a row-wise GEMM."""
    from fusible.quantization.tensor import ops as float8_ops
    from fusible.quantization.gemm import native_rowwise_gemm
    native_rowwise_gemm("cpu")  # its one probe GEMM (cached) before the spy: run alone too
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(
        (k["scale_a"].shape, k["scale_b"].shape)) or real(*a, **k))
    x, w, xq, wq = _rowwise_pair()
    y = xq @ wq.t()
    assert calls == [((24, 1), (1, 40))]
    want = xq.dequantize().double() @ wq.dequantize().double().t()
    assert snr_db(y, want) > 60  # float32 accumulation of the same operands
    dy = quantize_rowwise(torch.randn(24, 40), E4M3)
    dx = dy @ wq.t().t()  # w as (40, 64) read column-major: its per-feature copy
    assert calls[-1] == ((24, 1), (1, 64))
    assert snr_db(dx, dy.dequantize().double() @ wq.t().dequantize().double().t()) > 60
    # a scale along the contraction: no scaled_mm, the dequantized product
    assert float8_ops.gemm_operands(xq, quantize_rowwise(w.t().contiguous(), E4M3)) is None
    calls.clear()
    z = xq @ quantize_rowwise(w.t().contiguous(), E4M3)
    assert not calls and z.shape == (24, 40)


def test_rowwise_in_place_update_keeps_row_scales():
    """An optimizer-style update of a row-scaled Float8Tensor quantizes it again per row
    (and its copy per feature), in place."""
    x, _, xq, _ = _rowwise_pair()
    data_ptr = xq._data.data_ptr()
    xq.mul_(2.0)
    assert xq._data.data_ptr() == data_ptr and xq.scale_inv.shape == (24, 1)
    assert snr_db(xq.dequantize(), 2 * x) > 28 and snr_db(xq.t().dequantize(), 2 * x.t()) > 28
