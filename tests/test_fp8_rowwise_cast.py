"""The row-wise FP8 cast (issue 16's first building block): each row by its own scale,
the transposed copy per row of its own layout; what it gains over one scale per tensor."""

import pytest
import torch

from fusible.quantization.cast import cast_to_fp8_rowwise, cast_to_fp8_torch
from fusible.testing import snr_db

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_each_row_is_the_per_tensor_cast_of_that_row(fp8_dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 40) * torch.logspace(-4, 4, 6).view(1, 6, 1)
    data, scale_inv, transpose, t_scale_inv = cast_to_fp8_rowwise(x, fp8_dtype, True, True)
    assert data.shape == x.shape and scale_inv.shape == (12, 1)
    assert transpose.shape == (40, 12) and t_scale_inv.shape == (40, 1)
    rows, cols = x.reshape(12, 40), x.reshape(12, 40).t()
    for i, row in enumerate(rows):
        d, s = cast_to_fp8_torch(row, fp8_dtype)
        assert torch.equal(data.reshape(12, 40)[i].view(torch.uint8), d.view(torch.uint8))
        assert scale_inv[i, 0] == s
    for j, col in enumerate(cols):  # the copy: per feature, not the data transposed
        d, s = cast_to_fp8_torch(col, fp8_dtype)
        assert torch.equal(transpose[j].view(torch.uint8), d.view(torch.uint8))
        assert t_scale_inv[j, 0] == s
    assert scale_inv.max() / scale_inv.min() > 1e6  # the rows' magnitudes, one scale each


def test_special_rows_stay_in_their_row():
    x = torch.randn(5, 16)
    x[1] = 0.0  # scale 1
    x[2] = 1e-38  # the scale stops at the largest float32: finite
    x[3, 4] = float("nan")  # that row NaN, the others not
    data, scale_inv, _, _ = cast_to_fp8_rowwise(x, E4M3)
    assert scale_inv[1, 0] == 1 and not data[1].float().any()
    assert scale_inv[2].isfinite().all() and data[2].float().isfinite().all()
    assert data[3].float().isnan().all() and scale_inv[3].isnan().all()
    kept = [0, 1, 2, 4]
    assert data[kept].float().isfinite().all() and scale_inv[kept].isfinite().all()
    only_t = cast_to_fp8_rowwise(x[[0, 4]], E4M3, rowwise=False, columnwise=True)
    assert only_t[0] is None and only_t[1] is None and only_t[2].shape == (16, 2)
    with pytest.raises(ValueError, match="asked for neither"):
        cast_to_fp8_rowwise(x, E4M3, rowwise=False)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        cast_to_fp8_rowwise(x, torch.bfloat16)
    empty = cast_to_fp8_rowwise(torch.randn(0, 8), E4M3, True, True)
    assert empty[0].shape == (0, 8) and empty[3].shape == (8, 1) and (empty[3] == 1).all()


def test_rows_of_different_magnitudes_keep_their_precision():
    """Per-row outliers (rows 2^-8 to 2^8 apart): one scale per tensor leaves the small
    rows E4M3's subnormals (about 17 dB here), one per row keeps E4M3's precision in each
    (about 32)."""
    torch.manual_seed(0)
    x = torch.randn(64, 128) * (2.0 ** torch.randint(-8, 9, (64, 1))).float()
    data, scale_inv, _, _ = cast_to_fp8_rowwise(x, E4M3)
    per_row = data.float() * scale_inv
    d, s = cast_to_fp8_torch(x, E4M3)
    per_tensor = d.float() * s
    small = x.abs().amax(1) < 2.0 ** -4
    row_snr = snr_db(per_row[small], x[small])
    tensor_snr = snr_db(per_tensor[small], x[small])
    assert row_snr > 28 and row_snr > tensor_snr + 12, (row_snr, tensor_snr)
    assert snr_db(per_row, x) > 28
