"""LayerNorm and RMSNorm forward and backward as Triton kernels, float32 in registers only.

Rows are the tokens, ``N`` the normalised size; ``CENTER`` selects LayerNorm (subtract the
mean, add a bias) over RMSNorm. The forward reads a row for its statistics (LayerNorm: the
mean, then the variance around it; two reads, the second from L2) and again to write ``y``
and the float32 statistics the backward needs: no float32 copy of ``x`` or ``y`` is ever
written. The backward holds rows up to 16384 wide in one program and reads each once
(wider rows: column tiles, read twice); each program adds its rows' ``dy * x_hat`` (and
``dy``) into its own row of small float32 partial-sum buffers, summed over programs
afterwards for ``dweight`` (and ``dbias``): deterministic, no atomics.

When the next linear layer takes ``y`` in FP8, ``y`` is never written in high precision: a
first pass computes the statistics and the absolute maximum of the rounded ``y``, a second
computes ``y`` again over 2-D tiles and writes the FP8 data and its transposed copy (the
bits of the plain kernel followed by the FP8 cast).
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl, triton
from fusible.kernels.fp8_cast import (fp8_buffers, fp8_results, max_keep_nan, quantize_tile,
                                      scale_from_amax, store_fp8_tile, store_transposed_tile,
                                      tile_coords, tile_grid, transposes_in_kernel,
                                      zeroed_amax)
from fusible.kernels.fp8_delayed import DelayedCast, finish, kernel_args, record_delayed


@jit
def _tile(ptr, rows, cols, M, N):
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32), offs, mask


@jit
def _row_stats(x_ptr, rows, M, N, eps, CENTER: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """``(mean, rstd)`` of each row (``mean`` 0 without ``CENTER``)."""
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if CENTER:
        for start in range(0, N, BLOCK_N):
            x, _, _ = _tile(x_ptr, rows, start + tl.arange(0, BLOCK_N), M, N)
            mean += tl.sum(x, axis=1)
        mean = mean / N
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x, _, mask = _tile(x_ptr, rows, start + tl.arange(0, BLOCK_N), M, N)
        d = tl.where(mask, x - mean[:, None], 0.0)
        acc += tl.sum(d * d, axis=1)
    return mean, 1.0 / tl.sqrt(acc / N + eps)


@jit
def _normalized(x_ptr, w_ptr, b_ptr, rows, cols, mean, rstd, M, N, CENTER: tl.constexpr):
    """The tile of ``y`` rounded to ``x``'s dtype, in float32; its offsets and mask."""
    x, offs, mask = _tile(x_ptr, rows, cols, M, N)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
    if CENTER:
        y += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return y.to(x_ptr.dtype.element_ty).to(tl.float32), offs, mask


@jit
def _norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, amax_ptr, M, N, eps,
                     CENTER: tl.constexpr, AMAX_ONLY: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """The statistics and ``y``, or (``AMAX_ONLY``) the statistics and ``y``'s
    absolute maximum."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mean, rstd = _row_stats(x_ptr, rows, M, N, eps, CENTER, BLOCK_M, BLOCK_N)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    if CENTER:
        tl.store(mean_ptr + rows, mean, mask=rows < M)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        y, offs, mask = _normalized(x_ptr, w_ptr, b_ptr, rows, cols, mean, rstd, M, N,
                                    CENTER)
        if AMAX_ONLY:
            amax = tl.maximum(amax, tl.reduce(tl.where(mask, tl.abs(y), 0.0), 1,
                                              max_keep_nan),
                              propagate_nan=tl.PropagateNan.ALL)
        else:
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    if AMAX_ONLY:
        tl.atomic_max(amax_ptr, tl.reduce(amax, 0, max_keep_nan))


@jit
def _norm_fwd_cast_kernel(x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, amax_ptr, data_ptr,
                          t_ptr, scale_inv_ptr, M, N, FP8_MAX, state_ptr, ticket_ptr,
                          MARGIN_FACTOR, CENTER: tl.constexpr, HAS_T: tl.constexpr,
                          HAS_DATA: tl.constexpr, DELAYED: tl.constexpr, ROLL: tl.constexpr,
                          MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The second FP8 pass, over 2-D tiles (the transposed copy's stores stay coalesced);
    without ``HAS_DATA`` only the transposed copy is written; ``DELAYED``: ``y``'s amax
    recorded in the state."""
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, cols, _ = tile_coords(M, N, BLOCK_M, BLOCK_N)
    rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if CENTER:
        mean = tl.load(mean_ptr + rows, mask=rows < M, other=0.0)
    y, _, mask = _normalized(x_ptr, w_ptr, b_ptr, rows, cols, mean, rstd, M, N, CENTER)
    if HAS_DATA:
        store_fp8_tile(y, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N,
                       FP8_MAX, HAS_T)
    else:
        store_transposed_tile(quantize_tile(y, scale, scale_inv_ptr, FP8_MAX), rows, cols,
                              mask, t_ptr, M)
    if DELAYED:
        record_delayed(y, mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL, MOST_RECENT,
                       HISTORY, BLOCK_H)


@jit
def _norm_bwd_row_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, add_ptr,
                         dw_part_ptr, db_part_ptr, M, N, rows_per_program,
                         CENTER: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                         NEED_DB: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """The backward for rows that fit in one tile, ``BLOCK_M`` rows at a time (narrow rows
    would otherwise leave each step waiting on its loads): each row read once,
    ``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`` with ``g = dy * w``
    (``mean(g)`` only with ``CENTER``; ``HAS_ADD``: plus ``add``, in float32, rounded
    once); the parameter gradients' partial sums kept in registers and stored once per
    program, as a column of the ``(N, programs)`` partial buffers (whose rows the caller
    sums: a reduction along contiguous memory)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, rows_per_program, BLOCK_M):
        rows = pid * rows_per_program + start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if CENTER:
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        x_hat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
        if NEED_DX:
            g = dy * w[None, :]
            c1 = tl.sum(g * x_hat, axis=1) / N
            c0 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            if CENTER:
                c0 = tl.sum(g, axis=1) / N
            dx = rstd[:, None] * (g - c0[:, None] - x_hat * c1[:, None])
            if HAS_ADD:
                dx += tl.load(add_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        if NEED_DW:
            dw += tl.sum(dy * x_hat, axis=0)
        if NEED_DB:
            db += tl.sum(dy, axis=0)
    part = cols.to(tl.int64) * tl.num_programs(0) + pid  # (N, programs): summed along rows
    if NEED_DW:
        tl.store(dw_part_ptr + part, dw, mask=col_ok)
    if NEED_DB:
        tl.store(db_part_ptr + part, db, mask=col_ok)


@jit
def _norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, add_ptr, dw_part_ptr,
                     db_part_ptr, M, N, rows_per_program, CENTER: tl.constexpr,
                     NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                     HAS_ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The backward of :func:`_norm_bwd_row_kernel` for rows wider than a tile: each row
    read twice (the second time mostly from L2); partial sums added into this
    program's column of the (zeroed) partial buffers."""
    pid = tl.program_id(0)
    for row_start in range(0, rows_per_program, BLOCK_M):
        rows = pid * rows_per_program + row_start + tl.arange(0, BLOCK_M)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if CENTER:
            mean = tl.load(mean_ptr + rows, mask=rows < M, other=0.0)
        c0 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        c1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NEED_DX:
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                dy, _, mask = _tile(dy_ptr, rows, cols, M, N)
                x, _, _ = _tile(x_ptr, rows, cols, M, N)
                w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                g = dy * w[None, :]
                c1 += tl.sum(g * tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0),
                             axis=1)
                if CENTER:
                    c0 += tl.sum(g, axis=1)
            c0, c1 = c0 / N, c1 / N
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            dy, offs, mask = _tile(dy_ptr, rows, cols, M, N)
            x, _, _ = _tile(x_ptr, rows, cols, M, N)
            x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            if NEED_DX:
                w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                dx = rstd[:, None] * (dy * w[None, :] - c0[:, None] - x_hat * c1[:, None])
                if HAS_ADD:
                    dx += tl.load(add_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            col_ok = cols < N
            part = cols.to(tl.int64) * tl.num_programs(0) + pid
            if NEED_DW:
                acc = tl.load(dw_part_ptr + part, mask=col_ok, other=0.0)
                tl.store(dw_part_ptr + part, acc + tl.sum(dy * x_hat, axis=0), mask=col_ok)
            if NEED_DB:
                acc = tl.load(db_part_ptr + part, mask=col_ok, other=0.0)
                tl.store(db_part_ptr + part, acc + tl.sum(dy, axis=0), mask=col_ok)


def _blocks(n: int, block_n: int | None) -> tuple:
    """``(BLOCK_M, BLOCK_N)``: about 2048 elements a tile, a whole row where it fits."""
    block_n = block_n or min(triton.next_power_of_2(max(n, 1)), 2048)
    return max(1, min(16, 2048 // block_n)), block_n


# Rows up to this wide are held whole in one program's registers by the backward, in tiles
# of about _ROW_TILE elements (several rows at once where rows are narrower), _ROW_WARPS
# warps a program (None: one per 512 elements, 4 to 16), _PROGRAMS_PER_SM programs a
# multiprocessor (diagnostics/bf16_kernel_tiles.py sweeps the three)
_WHOLE_ROW_MAX = 16384
_ROW_TILE = 2048
_ROW_WARPS = None
_PROGRAMS_PER_SM = 4
_CAST_BLOCK = (64, 128)  # the tile of the FP8 cast pass


def _programs(m: int, device: torch.device) -> int:
    """Enough programs to fill the GPU a few times over, at most one per row."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 8)
    return max(1, min(m, _PROGRAMS_PER_SM * sms))


def _stats_buffers(x: torch.Tensor, weight: torch.Tensor, center: bool) -> tuple:
    """``(mean or None, rstd)``: float32, a trailing size-1 dimension per normalised one."""
    shape = x.shape[:x.dim() - weight.dim()] + (1,) * weight.dim()
    rstd = torch.empty(shape, device=x.device, dtype=torch.float32)
    return (torch.empty_like(rstd) if center else None), rstd


def _rows(x: torch.Tensor, n: int) -> int:
    return x.numel() // n if n else 0


def _bias_arg(bias: torch.Tensor | None, w: torch.Tensor, center: bool) -> torch.Tensor:
    """The kernels' bias: LayerNorm's (``center``), else the weight (an unread pointer)."""
    if not center:
        return w
    assert bias is not None  # LayerNorm has one
    return bias.contiguous()


def norm_forward_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float, center: bool, block_n: int | None = None) -> tuple:
    """``(y, mean, rstd)`` over the trailing ``weight.numel()`` elements of each row:
    LayerNorm with ``center`` (``bias`` added), RMSNorm without (``mean`` None). ``y`` in
    ``x``'s dtype; the statistics float32 with a trailing size-1 dimension per normalised
    one, as ``torch.native_layer_norm`` gives them."""
    require_triton("norm_forward_triton")
    x, w, n = x.contiguous(), weight.contiguous(), weight.numel()
    m = _rows(x, n)
    y = torch.empty_like(x)
    mean, rstd = _stats_buffers(x, weight, center)
    if m:
        block_m, block_n = _blocks(n, block_n)
        b = _bias_arg(bias, w, center)
        _norm_fwd_kernel[(triton.cdiv(m, block_m),)](
            x, w, b, y, rstd if mean is None else mean, rstd, rstd, m, n, eps, CENTER=center,
            AMAX_ONLY=False, BLOCK_M=block_m, BLOCK_N=block_n)
    return y, mean, rstd


def norm_forward_fp8_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            eps: float, center: bool, fp8_dtype: torch.dtype, fp8_max: float,
                            columnwise: bool, delayed: DelayedCast | None = None,
                            block_n: int | None = None, cast_block: tuple | None = None,
                            amax: torch.Tensor | None = None) -> tuple:
    """``([data, scale_inv] (+ transposed copy), mean, rstd)``: :func:`norm_forward_triton`
    with ``y`` in ``fp8_dtype`` (current per-tensor scale, or ``delayed``'s, which records
    ``y``'s amax), as the FP8 cast of its ``y`` would give, never written in ``x``'s dtype.
    ``amax``: a zeroed float32 0-d tensor to accumulate ``y``'s absolute maximum in,
    which the caller keeps (by default a slot of
    :func:`~fusible.kernels.fp8_cast.zeroed_amax`, reused later)."""
    require_triton("norm_forward_fp8_triton")
    x, w, n = x.contiguous(), weight.contiguous(), weight.numel()
    m = _rows(x, n)
    if not m or not n:
        raise ValueError(f"norm_forward_fp8_triton: empty input {tuple(x.shape)}")
    mean, rstd = _stats_buffers(x, weight, center)
    b = _bias_arg(bias, w, center)
    mean_or_rstd = rstd if mean is None else mean  # an unused pointer for RMSNorm
    amax = zeroed_amax(x.device) if amax is None else amax
    block_m, block_n = _blocks(n, block_n)
    _norm_fwd_kernel[(triton.cdiv(m, block_m),)](  # y_ptr: unused in this pass
        x, w, b, x, mean_or_rstd, rstd, amax, m, n, eps, CENTER=center, AMAX_ONLY=True,
        BLOCK_M=block_m, BLOCK_N=block_n)
    parts = norm_cast_fp8_triton(x, w, b, mean, rstd, amax if delayed is None else delayed.state,
                                 center, fp8_dtype, fp8_max, columnwise, cast_block,
                                 delayed=delayed)
    return parts, mean, rstd


def norm_cast_fp8_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         mean: torch.Tensor | None, rstd: torch.Tensor, amax: torch.Tensor,
                         center: bool, fp8_dtype: torch.dtype, fp8_max: float,
                         columnwise: bool, cast_block: tuple | None = None,
                         rowwise: bool = True, delayed: DelayedCast | None = None) -> list:
    """``[data, scale_inv]`` (+ transposed copy): the norm's output from its statistics,
    quantized by the scale of ``amax``: :func:`norm_forward_fp8_triton`'s second pass, also
    what recomputes that output bit for bit in a backward. Without ``rowwise`` (with
    ``columnwise``): ``[transposed copy, scale_inv]``, the data not written where the
    kernel writes the copy itself. ``delayed`` (``amax`` its state): the amax recorded."""
    require_triton("norm_cast_fp8_triton")
    if not (rowwise or columnwise):
        raise ValueError("norm_cast_fp8_triton: asked for neither the data nor its transpose")
    x, w, n = x.contiguous(), weight.contiguous(), weight.numel()
    m = _rows(x, n)
    b = _bias_arg(bias, w, center)
    # The transposed copy is (last dimension, the rest): the kernel's (N, M) tiles are that
    # only when one dimension is normalised; otherwise it comes from the FP8 data afterwards.
    kernel_t = columnwise and weight.dim() == 1
    has_data = rowwise or not (kernel_t and transposes_in_kernel(x.dtype))
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(x, fp8_dtype, kernel_t, has_data)
    cast_m, cast_n = cast_block or _CAST_BLOCK
    _norm_fwd_cast_kernel[tile_grid(m, n, cast_m, cast_n)](
        x, w, b, rstd if mean is None else mean, rstd, amax, data, transpose, scale_inv, m, n,
        fp8_max, **kernel_args(delayed, amax), CENTER=center, HAS_T=in_kernel_t,
        HAS_DATA=has_data, BLOCK_M=cast_m, BLOCK_N=cast_n)
    finish(delayed)
    out = fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)
    return out if rowwise else [out[2], scale_inv]


def norm_backward_triton(grad_output: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None,
                         rstd: torch.Tensor, weight: torch.Tensor, center: bool, need_dx: bool,
                         need_dw: bool, need_db: bool = False, block_n: int | None = None,
                         programs: int | None = None,
                         accumulate_into: torch.Tensor | None = None) -> tuple:
    """``(dx, dweight, dbias)`` of :func:`norm_forward_triton`, each None where not needed
    (``dbias`` only with ``center``); the parameter gradients sum the float32 per-program
    sums, rounded once to ``weight``'s dtype. Rows up to 16384 wide are held whole (unless
    ``block_n`` asks for narrower tiles). ``accumulate_into`` (``x``'s shape) is added to
    ``dx`` in the kernel, in float32: one rounding."""
    require_triton("norm_backward_triton")
    dy, x, w, n = grad_output.contiguous(), x.contiguous(), weight.contiguous(), weight.numel()
    need_db = need_db and center
    m = _rows(x, n)
    dx = torch.empty_like(x, dtype=dy.dtype) if need_dx else None
    if not (need_dx or need_dw or need_db):
        return None, None, None
    if not m:
        zeros = torch.zeros_like(weight)
        return dx, (zeros if need_dw else None), (zeros.clone() if need_db else None)
    add = accumulate_into.contiguous() if accumulate_into is not None and need_dx else None
    whole = triton.next_power_of_2(n)
    whole_row = (block_n is None or block_n >= whole) and n <= _WHOLE_ROW_MAX
    block_m, block_n = (max(1, _ROW_TILE // whole), whole) if whole_row else _blocks(n, block_n)
    programs = min(programs or _programs(m, x.device), triton.cdiv(m, block_m))
    rows_per_program = triton.cdiv(triton.cdiv(m, programs), block_m) * block_m
    programs = triton.cdiv(m, rows_per_program)
    make = torch.empty if whole_row else torch.zeros
    dw_part, db_part = (make((n, programs) if need else (1,), device=x.device,
                             dtype=torch.float32) for need in (need_dw, need_db))
    args = (dy, x, w, rstd if mean is None else mean.contiguous(), rstd.contiguous(),
            dx if need_dx else dy, dy if add is None else add, dw_part, db_part, m, n,
            rows_per_program)
    flags = dict(CENTER=center, NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db,
                 HAS_ADD=add is not None)
    if whole_row:
        warps = _ROW_WARPS or max(4, min(16, block_m * block_n // 512))
        _norm_bwd_row_kernel[(programs,)](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n,
                                          num_warps=warps)
    else:
        _norm_bwd_kernel[(programs,)](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n)
    dw = dw_part.sum(1).view(weight.shape).to(weight.dtype) if need_dw else None
    db = db_part.sum(1).view(weight.shape).to(weight.dtype) if need_db else None
    return dx, dw, db
