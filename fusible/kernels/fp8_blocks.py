"""FP8 cast with one scale per block (``1 x G`` tiles or ``G x G`` blocks), the kernel of
the blockwise and MX recipes (:mod:`fusible.quantization.casts.blocks` has the
PyTorch version, the same bits).

Each program reads one ``TILE x TILE`` tile of ``x`` once and writes, from it, the data
scaled per block of its rows and the transposed copy scaled per block of the copy's
rows (``G`` rows of ``x``), or for square blocks the same values transposed. The
transposed store happens in the kernel for bfloat16 sources only
(:func:`fusible.kernels.fp8_cast.transposes_in_kernel`); other sources get the copy
quantized in ``x``'s layout and transposed after (same bits).
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl
from fusible.kernels.fp8_cast import (max_keep_nan, saturate, scale_of_amax,
                                      store_transposed_tile, transposed_copy,
                                      transposes_in_kernel)

TILE = 128


@jit
def _scale_pair(amax, FP8_MAX, POWER2: tl.constexpr):
    """``(scale, scale_inv)`` of blocks with absolute maxima ``amax``: current scaling, or
    the power of two at or above ``amax / FP8_MAX`` from the quotient's bits (NaN for a
    NaN or inf amax, 1 for 0, at least 2^-127)."""
    if POWER2:
        v = tl.math.div_rn(amax, FP8_MAX)
        bits = v.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        e = biased - 127 + (mantissa != 0).to(tl.int32)
        e = tl.where(biased == 0, tl.where(mantissa > 0x400000, -126, -127), e)
        e = tl.minimum(tl.maximum(e, -127), 127)
        bits = tl.where(e >= -126, (e + 127) << 23, 0x00400000)  # 2^-127: a subnormal
        scale_inv = bits.to(tl.float32, bitcast=True)
        scale_inv = tl.where(amax == 0.0, 1.0, scale_inv)
        scale_inv = tl.where(amax < float("inf"), scale_inv, float("nan"))
        return tl.math.div_rn(1.0, scale_inv), scale_inv
    scale = scale_of_amax(amax, FP8_MAX)
    return scale, tl.math.div_rn(1.0, scale)


@jit
def _blocks_kernel(x_ptr, data_ptr, scale_ptr, t_ptr, t_scale_ptr, M, N, FP8_MAX,
                   G: tl.constexpr, SQUARE: tl.constexpr, POWER2: tl.constexpr,
                   HAS_DATA: tl.constexpr, HAS_T: tl.constexpr, T_IN_KERNEL: tl.constexpr,
                   TILE: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * TILE + tl.arange(0, TILE)
    cols = pid_n * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    nb_m, nb_n = tl.cdiv(M, G), tl.cdiv(N, G)
    if SQUARE:  # G == TILE: one scale for the tile, shared by the transposed copy
        amax = tl.reduce(tl.reduce(tl.abs(x), 1, max_keep_nan), 0, max_keep_nan)
        scale, scale_inv = _scale_pair(amax, FP8_MAX, POWER2)
        v = saturate(x * scale, FP8_MAX)
        if HAS_DATA:
            tl.store(scale_ptr + pid_m * nb_n + pid_n, scale_inv)
            tl.store(data_ptr + offs, v.to(data_ptr.dtype.element_ty,
                                           fp_downcast_rounding="rtne"), mask=mask)
        if HAS_T:
            tl.store(t_scale_ptr + pid_n * nb_m + pid_m, scale_inv)
            _store_copy(v, rows, cols, mask, offs, t_ptr, M, T_IN_KERNEL)
    else:
        if HAS_DATA:  # 1 x G tiles along the rows
            xr = tl.reshape(x, (TILE, TILE // G, G))
            amax = tl.reduce(tl.abs(xr), 2, max_keep_nan)
            scale, scale_inv = _scale_pair(amax, FP8_MAX, POWER2)
            v = saturate(tl.reshape(xr * scale[:, :, None], (TILE, TILE)), FP8_MAX)
            tl.store(data_ptr + offs, v.to(data_ptr.dtype.element_ty,
                                           fp_downcast_rounding="rtne"), mask=mask)
            blocks = pid_n * (TILE // G) + tl.arange(0, TILE // G)
            tl.store(scale_ptr + rows[:, None].to(tl.int64) * nb_n + blocks[None, :],
                     scale_inv, mask=(rows[:, None] < M) & (blocks[None, :] < nb_n))
        if HAS_T:  # G x 1 tiles of x: 1 x G along the copy's rows
            xc = tl.reshape(x, (TILE // G, G, TILE))
            amax = tl.reduce(tl.abs(xc), 1, max_keep_nan)
            scale, scale_inv = _scale_pair(amax, FP8_MAX, POWER2)
            v = saturate(tl.reshape(xc * scale[:, None, :], (TILE, TILE)), FP8_MAX)
            _store_copy(v, rows, cols, mask, offs, t_ptr, M, T_IN_KERNEL)
            blocks = pid_m * (TILE // G) + tl.arange(0, TILE // G)
            tl.store(t_scale_ptr + cols[None, :].to(tl.int64) * nb_m + blocks[:, None],
                     scale_inv, mask=(cols[None, :] < N) & (blocks[:, None] < nb_m))


@jit
def _store_copy(v, rows, cols, mask, offs, t_ptr, M, T_IN_KERNEL: tl.constexpr):
    """The copy's values: transposed into the (N, M) copy, or in ``x``'s layout (a
    buffer transposed after the kernel)."""
    if T_IN_KERNEL:
        store_transposed_tile(v, rows, cols, mask, t_ptr, M)
    else:
        tl.store(t_ptr + offs, v.to(t_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=mask)


def cast_blocks_triton(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, group: int,
                       square: bool, power2: bool, rowwise: bool = True,
                       columnwise: bool = False) -> list:
    """``[data, scale_inv, transpose, transpose_scale_inv]`` of the 2-D ``x`` (M, N), None
    where not asked for (see :func:`fusible.quantization.casts.blocks.cast_blocks`);
    ``group`` divides 128, and is 128 for ``square`` blocks."""
    require_triton("cast_blocks_triton")
    if TILE % group or (square and group != TILE):
        raise ValueError(f"cast_blocks_triton: group must divide {TILE} (and be {TILE} for "
                         f"square blocks), got {group}")
    x = x.contiguous()
    m, n = x.shape
    nb_m, nb_n = -(-m // group), -(-n // group)
    new = x.new_empty
    data = new((m, n), dtype=fp8_dtype) if rowwise else None
    scale = new((nb_m if square else m, nb_n), dtype=torch.float32) if rowwise else None
    in_kernel = transposes_in_kernel(x.dtype)
    t = t_scale = None
    if columnwise:
        t = new((n, m) if in_kernel else (m, n), dtype=fp8_dtype)
        t_scale = new((nb_n if square else n, nb_m), dtype=torch.float32)
    dummy = new((1,), dtype=fp8_dtype)
    _blocks_kernel[(-(-m // TILE), -(-n // TILE))](
        x, data if rowwise else dummy, scale if rowwise else dummy, t if columnwise else dummy,
        t_scale if columnwise else dummy, m, n, fp8_max, G=group, SQUARE=square,
        POWER2=power2, HAS_DATA=rowwise, HAS_T=columnwise, T_IN_KERNEL=in_kernel, TILE=TILE,
        num_warps=8)
    if t is not None and not in_kernel:  # columnwise
        t = transposed_copy(t)
    if power2:
        scale = None if scale is None else scale.to(torch.float8_e8m0fnu)
        t_scale = None if t_scale is None else t_scale.to(torch.float8_e8m0fnu)
    return [data, scale, t, t_scale]
