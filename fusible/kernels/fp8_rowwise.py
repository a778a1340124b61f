"""FP8 cast with one scale per row (row-wise current scaling), the building block of the
row-wise recipe (issue 16): each program takes whole rows, reads them once for their
absolute maxima and once more to write the FP8 data, with the per-tensor kernel's
arithmetic row by row (:mod:`fusible.kernels.fp8_cast`), so the PyTorch version gives
the same bits. The transposed copy is scaled per row of its own layout (per column of
``x``), as a GEMM contracting over the other dimension needs: it is the same cast of the
transposed ``x``.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl
from fusible.kernels.fp8_cast import max_keep_nan, saturate, scale_of_amax


@jit
def _row_cast_kernel(x_ptr, data_ptr, scale_inv_ptr, M, N, FP8_MAX,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    base = rows[:, None].to(tl.int64) * N
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols[None, :] < N)
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.reduce(tl.abs(x), 1, max_keep_nan),
                          propagate_nan=tl.PropagateNan.ALL)
    scale = scale_of_amax(amax, FP8_MAX)
    tl.store(scale_inv_ptr + rows, tl.math.div_rn(1.0, scale), mask=row_ok)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols[None, :] < N)
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = saturate(x * scale[:, None], FP8_MAX)
        tl.store(data_ptr + base + cols[None, :],
                 v.to(data_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def cast_rows_triton(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                     block_m: int = 4, block_n: int = 1024) -> tuple:
    """``(data, scale_inv)``: the 2-D ``x`` (M, N) cast with one scale per row,
    ``scale_inv`` float32 (M, 1)."""
    require_triton("cast_rows_triton")
    x = x.contiguous()
    m, n = x.shape
    data = torch.empty((m, n), device=x.device, dtype=fp8_dtype)
    scale_inv = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    if m:
        _row_cast_kernel[(-(-m // block_m),)](x, data, scale_inv, m, n, fp8_max,
                                              BLOCK_M=block_m, BLOCK_N=block_n)
    return data, scale_inv
