"""FP8 cast with one scale per row (row-wise current scaling), the building block of the
row-wise recipe (issue 16): each program takes whole rows, reads them once for their
absolute maxima and once more to write the FP8 data, with the per-tensor kernel's
arithmetic row by row (:mod:`fusible.kernels.fp8_cast`), so the PyTorch version gives
the same bits. The transposed copy is scaled per row of its own layout (per column of
``x``), as a GEMM contracting over the other dimension needs: it is the same cast of the
transposed ``x``. Where that copy is wanted, two kernels instead do both layouts: one
read for the maxima of every row and every column (atomic maxima, order-independent),
one more to write the data and the copy, with no transposed ``x`` in high precision.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl
from fusible.kernels.fp8_cast import (max_keep_nan, saturate, scale_of_amax, store_transposed_tile,
                                      tile_coords, tile_grid, transposed_copy,
                                      transposes_in_kernel)


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


@jit
def _row_col_amax_kernel(x_ptr, row_amax_ptr, col_amax_ptr, M, N,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    a = tl.abs(x)
    tl.atomic_max(row_amax_ptr + rows, tl.reduce(a, 1, max_keep_nan), mask=rows < M)
    tl.atomic_max(col_amax_ptr + cols, tl.reduce(a, 0, max_keep_nan), mask=cols < N)


@jit
def _row_col_cast_kernel(x_ptr, row_amax_ptr, col_amax_ptr, data_ptr, scale_inv_ptr, t_ptr,
                         t_scale_inv_ptr, M, N, FP8_MAX, HAS_DATA: tl.constexpr,
                         T_IN_KERNEL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DATA:
        scale = scale_of_amax(tl.load(row_amax_ptr + rows, mask=rows < M, other=1.0), FP8_MAX)
        v = saturate(x * scale[:, None], FP8_MAX)
        tl.store(data_ptr + offs, v.to(data_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=mask)
        if tl.program_id(0) // tiles_m == 0:  # the first column strip: the rows' scales
            tl.store(scale_inv_ptr + rows, tl.math.div_rn(1.0, scale), mask=rows < M)
    t_scale = scale_of_amax(tl.load(col_amax_ptr + cols, mask=cols < N, other=1.0), FP8_MAX)
    v = saturate(x * t_scale[None, :], FP8_MAX)
    if T_IN_KERNEL:
        store_transposed_tile(v, rows, cols, mask, t_ptr, M)
    else:  # in x's layout, transposed after the kernel
        tl.store(t_ptr + offs, v.to(t_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=mask)
    if tl.program_id(0) % tiles_m == 0:  # the first row strip: the columns' scales
        tl.store(t_scale_inv_ptr + cols, tl.math.div_rn(1.0, t_scale), mask=cols < N)


def cast_rows_and_columns_triton(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                                 rowwise: bool = True, block_m: int = 64, block_n: int = 64,
                                 column_amax=None) -> list:
    """``[data, scale_inv, transpose, transpose_scale_inv]`` of the 2-D ``x`` (M, N): the
    data scaled per row (None without ``rowwise``), the (N, M) copy per row of its own
    layout (per column of ``x``); the scales float32 (M, 1) and (N, 1). Two kernels, two
    reads of ``x``. ``column_amax`` (N) replaces the columns' maxima where it is larger
    (a group's maxima, which are)."""
    require_triton("cast_rows_and_columns_triton")
    x = x.contiguous()
    m, n = x.shape
    amax = torch.zeros(m + n, device=x.device, dtype=torch.float32)
    if column_amax is not None:
        amax[m:].copy_(column_amax)
    new = x.new_empty
    data = new((m, n), dtype=fp8_dtype) if rowwise else None
    scale_inv = new((m, 1), dtype=torch.float32) if rowwise else None
    in_kernel = transposes_in_kernel(x.dtype)
    t = new((n, m) if in_kernel else (m, n), dtype=fp8_dtype)
    t_scale_inv = new((n, 1), dtype=torch.float32)
    if m and n:
        grid = tile_grid(m, n, block_m, block_n)
        _row_col_amax_kernel[grid](x, amax[:m], amax[m:], m, n, BLOCK_M=block_m,
                                   BLOCK_N=block_n)
        _row_col_cast_kernel[grid](x, amax[:m], amax[m:], data if rowwise else t,
                                   scale_inv if rowwise else t_scale_inv, t, t_scale_inv, m, n,
                                   fp8_max, HAS_DATA=rowwise, T_IN_KERNEL=in_kernel,
                                   BLOCK_M=block_m, BLOCK_N=block_n)
    elif m or n:
        if scale_inv is not None:  # rowwise
            scale_inv.fill_(1.0)
        t_scale_inv.fill_(1.0)
    if not in_kernel:
        t = transposed_copy(t)
    return [data, scale_inv, t, t_scale_inv]
