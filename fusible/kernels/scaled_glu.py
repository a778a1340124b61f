"""The scaled gated units (``y = glu(x) * s[row]``, a mixture of experts' router weights
applied inside the expert), forward and backward, one pass over memory each, float32 in
registers only; the FP8 output cast fused as in :mod:`fusible.kernels.swiglu` (an amax
pass, then a pass that writes the FP8 data and its transposed copy).

The forward is the plain unit's tile kernel with the row's scale applied before the
rounding. The backward needs ``ds[row] = sum(dy * glu(x))`` over the row: each program
takes whole rows and walks their columns, so the sum is a register accumulation in a
fixed order (deterministic, no atomics), and ``dx = glu'(x)(dy * s)`` is written (or
cast) in the same walk.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl, triton
from fusible.kernels.fp8_cast import (atomic_amax_of_tile, fp8_buffers, fp8_results,
                                      scale_from_amax, store_fp8_tile, tile_grid, zeroed_amax)
from fusible.kernels.fp8_delayed import finish, kernel_args, record_delayed, scale_amax
from fusible.kernels.swiglu import (CLAMP_DEFAULTS, _gated_tile, _half_cols, _layout,
                                    _rows_and_half, _swiglu_grads, _swiglu_tile,
                                    _swiglu_values, halves_amax)


@jit
def _scaled_fwd_kernel(x_ptr, s_ptr, y_ptr, amax_ptr, M, N, S, LIMIT, ALPHA, OFFSET,
                       KIND: tl.constexpr, INTERLEAVED: tl.constexpr, AMAX_ONLY: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y`` (``M x N``), or (``AMAX_ONLY``) only the absolute maximum of its values."""
    rows, cols, mask, _, _, a, b = _gated_tile(x_ptr, M, N, S, INTERLEAVED, BLOCK_M, BLOCK_N)
    s = tl.load(s_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)
    y = (_swiglu_values(a, b, LIMIT, ALPHA, OFFSET, KIND) * s[:, None]).to(
        x_ptr.dtype.element_ty)
    if AMAX_ONLY:
        atomic_amax_of_tile(y.to(tl.float32), mask, amax_ptr)
    else:
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y, mask=mask)


@jit
def _scaled_fwd_cast_kernel(x_ptr, s_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr, M, N, S,
                            LIMIT, ALPHA, OFFSET, FP8_MAX, state_ptr, ticket_ptr,
                            MARGIN_FACTOR, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
                            HAS_T: tl.constexpr, DELAYED: tl.constexpr, ROLL: tl.constexpr,
                            MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, cols, mask, _, _, a, b = _gated_tile(x_ptr, M, N, S, INTERLEAVED, BLOCK_M, BLOCK_N)
    s = tl.load(s_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)
    y = (_swiglu_values(a, b, LIMIT, ALPHA, OFFSET, KIND) * s[:, None]).to(
        x_ptr.dtype.element_ty)
    store_fp8_tile(y.to(tl.float32), scale, rows, cols, mask, data_ptr, t_ptr,
                   scale_inv_ptr, M, N, FP8_MAX, HAS_T)
    if DELAYED:
        record_delayed(y.to(tl.float32), mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL,
                       MOST_RECENT, HISTORY, BLOCK_H)


@jit
def _scaled_bwd_kernel(dy_ptr, x_ptr, s_ptr, dx_ptr, ds_ptr, amax_ptr, data_ptr, t_ptr,
                       scale_inv_ptr, M, N, S, LIMIT, ALPHA, OFFSET, FP8_MAX, state_ptr,
                       ticket_ptr, MARGIN_FACTOR, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
                       NEED_DX: tl.constexpr, NEED_DS: tl.constexpr, MODE: tl.constexpr,
                       HAS_T: tl.constexpr, DELAYED: tl.constexpr, ROLL: tl.constexpr,
                       MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whole rows per program. ``MODE`` 0: write ``dx``; 1: only fold ``dx``'s absolute
    maximum into ``amax``; 2: cast ``dx`` to FP8 by that maximum (``DELAYED``: by the
    state's, recording ``dx``'s). ``ds`` (where needed) is written by modes 0 and 1."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    s = tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if MODE == 2:
        scale = scale_from_amax(amax_ptr, FP8_MAX)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    seen = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # DELAYED: dx's amax so far
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols[None, :] < N)
        a_cols, b_cols = _half_cols(cols, N, S, INTERLEAVED)
        a, b = _swiglu_tile(x_ptr, rows, a_cols, b_cols, mask, N)
        dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        if NEED_DS and MODE != 2:
            acc += tl.sum(dy * _swiglu_values(a, b, LIMIT, ALPHA, OFFSET, KIND), 1)
        if NEED_DX:
            da, db = _swiglu_grads(dy * s[:, None], a, b, LIMIT, ALPHA, OFFSET, KIND)
            da = da.to(dy_ptr.dtype.element_ty)
            db = db.to(dy_ptr.dtype.element_ty)
            if MODE == 0:
                row_offs = rows[:, None].to(tl.int64) * (2 * N)
                tl.store(dx_ptr + row_offs + a_cols[None, :], da, mask=mask)
                tl.store(dx_ptr + row_offs + b_cols[None, :], db, mask=mask)
            elif MODE == 1:
                atomic_amax_of_tile(halves_amax(da, db), mask, amax_ptr)
            else:  # dx is M x 2N: the two halves are column tiles of it
                store_fp8_tile(da.to(tl.float32), scale, rows, a_cols, mask, data_ptr, t_ptr,
                               scale_inv_ptr, M, 2 * N, FP8_MAX, HAS_T)
                store_fp8_tile(db.to(tl.float32), scale, rows, b_cols, mask, data_ptr, t_ptr,
                               scale_inv_ptr, M, 2 * N, FP8_MAX, HAS_T)
                if DELAYED:
                    seen = tl.maximum(seen, tl.where(mask, halves_amax(da, db), 0.0),
                                      propagate_nan=tl.PropagateNan.ALL)
    if DELAYED and MODE == 2:
        record_delayed(seen, row_ok[:, None], state_ptr, ticket_ptr,
                       MARGIN_FACTOR, ROLL, MOST_RECENT, HISTORY, BLOCK_H)
    if NEED_DS and MODE != 2:
        tl.store(ds_ptr + rows, acc.to(ds_ptr.dtype.element_ty), mask=row_ok)


def scaled_glu_forward_triton(x: torch.Tensor, scales: torch.Tensor, output_format=None,
                              block_m: int = 32, block_n: int = 128, kind: str = "swiglu",
                              interleave: int = 0, clamp: tuple = CLAMP_DEFAULTS):
    """``glu(x) * scales[..., None]`` in ``x``'s dtype, rounded once; with
    ``output_format`` (``(fp8_dtype, fp8_max, columnwise[, delayed])``, a format's
    ``cast_args()``) its FP8 cast parts ``[data, scale_inv]`` (+ transposed copy) instead,
    the result never written in high precision."""
    require_triton("scaled_glu_forward_triton")
    x, s = x.contiguous(), scales.contiguous()
    m, n = _rows_and_half(x, kind, interleave)
    grid, layout = tile_grid(m, n, block_m, block_n), _layout(kind, interleave, clamp)
    if output_format is None:
        y = x.new_empty((*x.shape[:-1], n))
        if y.numel():
            _scaled_fwd_kernel[grid](x, s, y, y, m, n, **layout, AMAX_ONLY=False,
                                     BLOCK_M=block_m, BLOCK_N=block_n)
        return y
    if not m * n:
        raise ValueError(f"scaled_glu_forward_triton: empty input {tuple(x.shape)}")
    fp8_dtype, fp8_max, columnwise, delayed = _cast_args(output_format)
    amax = scale_amax(delayed, x.device, lambda slot: _scaled_fwd_kernel[grid](
        x, s, slot, slot, m, n, **layout, AMAX_ONLY=True, BLOCK_M=block_m, BLOCK_N=block_n))
    like = x.new_empty(()).expand(*x.shape[:-1], n)  # the result's shape, no memory
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(like, fp8_dtype, columnwise)
    _scaled_fwd_cast_kernel[grid](x, s, amax, data, transpose, scale_inv, m, n, **layout,
                                  FP8_MAX=fp8_max, **kernel_args(delayed, amax),
                                  HAS_T=in_kernel_t, BLOCK_M=block_m, BLOCK_N=block_n)
    finish(delayed)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)


def _cast_args(output_format: tuple) -> tuple:
    """``(fp8_dtype, fp8_max, columnwise, delayed or None)`` of a format's cast_args()."""
    return (*output_format, None) if len(output_format) == 3 else tuple(output_format)


def scaled_glu_backward_triton(grad_output: torch.Tensor, x: torch.Tensor,
                               scales: torch.Tensor, need_dx: bool, need_ds: bool,
                               output_format=None, block_m: int = 16, block_n: int = 128,
                               kind: str = "swiglu", interleave: int = 0,
                               clamp: tuple = CLAMP_DEFAULTS) -> tuple:
    """``(dx, ds)`` of :func:`scaled_glu_forward_triton` (None where not needed): ``dx =
    glu'(x)(dy * s)`` in ``dy``'s dtype, or with ``output_format`` its FP8 cast parts as
    the forward's; ``ds = sum(dy * glu(x), -1)`` in ``x``'s dtype, summed in float32 in
    column order."""
    require_triton("scaled_glu_backward_triton")
    dy, x, s = grad_output.contiguous(), x.contiguous(), scales.contiguous()
    m, n = _rows_and_half(x, kind, interleave)
    grid, layout = (triton.cdiv(m, block_m),), _layout(kind, interleave, clamp)
    ds = x.new_empty(x.shape[:-1]) if need_ds else None
    fp8 = need_dx and output_format is not None
    dx = torch.empty_like(x, dtype=dy.dtype) if need_dx and not fp8 else None
    if fp8 and not m * n:
        raise ValueError(f"scaled_glu_backward_triton: empty input {tuple(x.shape)}")
    if not m * n:
        return dx, ds.zero_() if ds is not None else None
    fp8_dtype, fp8_max, columnwise, delayed = _cast_args(output_format) if fp8 else \
        (None, 1.0, False, None)
    amax = zeroed_amax(x.device) if fp8 else dy
    spare = dx if dx is not None else dy  # an unused pointer
    kwargs = dict(**layout, NEED_DX=need_dx, BLOCK_M=block_m, BLOCK_N=block_n)
    if not (fp8 and delayed is not None and not need_ds):  # delayed: the first pass for ds
        _scaled_bwd_kernel[grid](dy, x, s, spare, ds if need_ds else spare, amax, spare,
                                 spare, spare, m, n, FP8_MAX=1.0, NEED_DS=need_ds,
                                 MODE=1 if fp8 else 0, HAS_T=False, **kernel_args(None, amax),
                                 **kwargs)
    if not fp8:
        return dx, ds
    amax = amax if delayed is None else delayed.state
    like = dy.new_empty(()).expand(x.shape)
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(like, fp8_dtype, columnwise)
    _scaled_bwd_kernel[grid](dy, x, s, spare, spare, amax, data, transpose, scale_inv, m, n,
                             FP8_MAX=fp8_max, NEED_DS=False, MODE=2, HAS_T=in_kernel_t,
                             **kernel_args(delayed, amax), **kwargs)
    finish(delayed)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t), ds
