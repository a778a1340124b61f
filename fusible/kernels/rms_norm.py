"""RMSNorm forward and backward as Triton kernels, float32 in registers only.

Rows are the tokens, ``N`` the normalised size. The forward reads ``x`` for the mean
square, then again (from L2 for the rows of one program) to write ``y`` and the float32
``rstd`` the backward needs: no float32 copy of ``x`` or ``y`` is ever written. The
backward reads ``dy`` and ``x`` for each row's ``sum(dy * w * x)``, then again to write
``dx``; each program adds its rows' ``dy * x_hat`` into its own row of a small float32
partial-sum buffer, summed over programs afterwards for ``dweight`` (deterministic: no
atomics).

When the next linear layer takes ``y`` in FP8, ``y`` is never written in high precision:
a first pass computes ``rstd`` and the absolute maximum of the rounded ``y``, a second
computes ``y`` again and writes the FP8 data and its transposed copy (the bits of the
plain kernel followed by the FP8 cast).
"""

from __future__ import annotations

import torch

from fusible.kernels import require_triton

try:
    import triton
    import triton.language as tl

    from fusible.kernels.fp8_cast import (fp8_buffers, fp8_results, max_keep_nan,
                                          scale_from_amax, store_fp8_tile)
except ImportError:  # Triton is optional: CPU-only installs use PyTorch ops
    triton = None


if triton is not None:

    @triton.jit
    def _tile(ptr, rows, cols, M, N):
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32), offs, mask

    @triton.jit
    def _rstd_of_rows(x_ptr, rows, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x, _, _ = _tile(x_ptr, rows, cols, M, N)
            acc += tl.sum(x * x, axis=1)
        return 1.0 / tl.sqrt(acc / N + eps)

    @triton.jit
    def _normalized(x_ptr, w_ptr, rows, cols, rstd, M, N, out_ty):
        """The tile of ``y`` rounded to ``out_ty``, in float32; its offsets and mask."""
        x, offs, mask = _tile(x_ptr, rows, cols, M, N)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = (x * rstd[:, None] * w[None, :]).to(out_ty).to(tl.float32)
        return y, offs, mask

    @triton.jit
    def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, amax_ptr, M, N, eps,
                             AMAX_ONLY: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        """``rstd`` and ``y``, or (``AMAX_ONLY``) ``rstd`` and the absolute maximum of ``y``."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rstd = _rstd_of_rows(x_ptr, rows, M, N, eps, BLOCK_M, BLOCK_N)
        tl.store(rstd_ptr + rows, rstd, mask=rows < M)
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            y, offs, mask = _normalized(x_ptr, w_ptr, rows, cols, rstd, M, N,
                                        x_ptr.dtype.element_ty)
            if AMAX_ONLY:
                amax = tl.maximum(amax, tl.reduce(tl.where(mask, tl.abs(y), 0.0), 1,
                                                  max_keep_nan),
                                  propagate_nan=tl.PropagateNan.ALL)
            else:
                tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        if AMAX_ONLY:
            tl.atomic_max(amax_ptr, tl.reduce(amax, 0, max_keep_nan))

    @triton.jit
    def _rms_norm_fwd_cast_kernel(x_ptr, w_ptr, rstd_ptr, amax_ptr, data_ptr, t_ptr,
                                  scale_inv_ptr, M, N, FP8_MAX, HAS_T: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The second FP8 pass, over 2-D tiles (the transposed copy's stores stay coalesced)."""
        scale = scale_from_amax(amax_ptr, FP8_MAX)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        y, _, mask = _normalized(x_ptr, w_ptr, rows, cols, rstd, M, N, x_ptr.dtype.element_ty)
        store_fp8_tile(y, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N,
                       FP8_MAX, HAS_T)

    @triton.jit
    def _rms_norm_bwd_row_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, partial_ptr, M, N,
                                 rows_per_program, NEED_DX: tl.constexpr,
                                 NEED_DW: tl.constexpr, BLOCK_N: tl.constexpr):
        """The backward for rows that fit in one tile: each row read once, ``dweight``'s
        partial sum kept in registers and stored once per program."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for i in range(0, rows_per_program):
            row = pid * rows_per_program + i
            ok = col_ok & ((row + tl.zeros((BLOCK_N,), dtype=tl.int32)) < M)
            offs = row.to(tl.int64) * N + cols
            dy = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + tl.minimum(row, M - 1))  # past M: every store masked
            if NEED_DX:
                c = tl.sum(dy * w * x, axis=0) / N * rstd * rstd * rstd
                dx = rstd * dy * w - x * c
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=ok)
            if NEED_DW:
                acc += dy * x * rstd
        if NEED_DW:
            tl.store(partial_ptr + pid.to(tl.int64) * N + cols, acc, mask=col_ok)

    @triton.jit
    def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, partial_ptr, M, N,
                             rows_per_program, NEED_DX: tl.constexpr,
                             NEED_DW: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        """``dx = rstd * g - x * rstd**3 * mean(g * x)`` with ``g = dy * w``; this program's
        ``sum over its rows of dy * x * rstd`` into row ``program_id`` of ``partial``. For
        rows wider than a tile: each row read twice (the second time mostly from L2)."""
        pid = tl.program_id(0)
        partial_row = partial_ptr + pid.to(tl.int64) * N
        for row_start in range(0, rows_per_program, BLOCK_M):
            rows = pid * rows_per_program + row_start + tl.arange(0, BLOCK_M)
            rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
            c = tl.zeros((BLOCK_M,), dtype=tl.float32)
            if NEED_DX:
                for start in range(0, N, BLOCK_N):
                    cols = start + tl.arange(0, BLOCK_N)
                    dy, _, _ = _tile(dy_ptr, rows, cols, M, N)
                    x, _, _ = _tile(x_ptr, rows, cols, M, N)
                    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                    c += tl.sum(dy * w[None, :] * x, axis=1)
                c = c / N * rstd * rstd * rstd
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                dy, offs, mask = _tile(dy_ptr, rows, cols, M, N)
                x, _, _ = _tile(x_ptr, rows, cols, M, N)
                if NEED_DX:
                    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                    dx = rstd[:, None] * dy * w[None, :] - x * c[:, None]
                    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if NEED_DW:
                    col_ok = cols < N
                    acc = tl.load(partial_row + cols, mask=col_ok, other=0.0)
                    acc += tl.sum(dy * x * rstd[:, None], axis=0)
                    tl.store(partial_row + cols, acc, mask=col_ok)


def _blocks(n: int, block_n: int | None) -> tuple:
    """``(BLOCK_M, BLOCK_N)``: about 2048 elements a tile, a whole row where it fits."""
    block_n = block_n or min(triton.next_power_of_2(max(n, 1)), 2048)
    return max(1, min(16, 2048 // block_n)), block_n


# Rows up to this wide are held whole in one program's registers by the backward.
_WHOLE_ROW_MAX = 16384
_CAST_BLOCK = (64, 128)  # the tile of the FP8 cast pass


def _programs(m: int, device: torch.device) -> int:
    """Enough programs to fill the GPU a few times over, at most one per row."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 8)
    return max(1, min(m, 4 * sms))


def _rows(x: torch.Tensor, n: int) -> int:
    return x.numel() // n if n else 0


def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            block_n: int | None = None) -> tuple:
    """``(y, rstd)`` over the trailing ``weight.numel()`` elements of each row: ``y`` in
    ``x``'s dtype, ``rstd`` float32 with a trailing size-1 dimension per normalised one."""
    require_triton("rms_norm_forward_triton")
    x, n = x.contiguous(), weight.numel()
    m = _rows(x, n)
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:x.dim() - weight.dim()] + (1,) * weight.dim(),
                       device=x.device, dtype=torch.float32)
    if m:
        block_m, block_n = _blocks(n, block_n)
        _rms_norm_fwd_kernel[(triton.cdiv(m, block_m),)](
            x, weight.contiguous(), y, rstd, rstd, m, n, eps, AMAX_ONLY=False,
            BLOCK_M=block_m, BLOCK_N=block_n)
    return y, rstd


def rms_norm_forward_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                fp8_dtype: torch.dtype, fp8_max: float, columnwise: bool,
                                block_n: int | None = None,
                                cast_block: tuple | None = None) -> tuple:
    """``([data, scale_inv] (+ transposed copy), rstd)``: ``y`` in ``fp8_dtype`` with a
    current per-tensor scale, as the FP8 cast of :func:`rms_norm_forward_triton`'s ``y``
    would give, never written in ``x``'s dtype."""
    require_triton("rms_norm_forward_fp8_triton")
    x, w, n = x.contiguous(), weight.contiguous(), weight.numel()
    m = _rows(x, n)
    if not m or not n:
        raise ValueError(f"rms_norm_forward_fp8_triton: empty input {tuple(x.shape)}")
    rstd = torch.empty(x.shape[:x.dim() - weight.dim()] + (1,) * weight.dim(),
                       device=x.device, dtype=torch.float32)
    amax = torch.zeros((), device=x.device, dtype=torch.float32)
    block_m, block_n = _blocks(n, block_n)
    grid = (triton.cdiv(m, block_m),)
    _rms_norm_fwd_kernel[grid](x, w, x, rstd, amax, m, n, eps, AMAX_ONLY=True,
                               BLOCK_M=block_m, BLOCK_N=block_n)
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(x, fp8_dtype, columnwise)
    cast_m, cast_n = cast_block or _CAST_BLOCK
    _rms_norm_fwd_cast_kernel[(triton.cdiv(m, cast_m), triton.cdiv(n, cast_n))](
        x, w, rstd, amax, data, transpose, scale_inv, m, n, fp8_max, HAS_T=in_kernel_t,
        BLOCK_M=cast_m, BLOCK_N=cast_n)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t), rstd


def rms_norm_backward_triton(grad_output: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                             weight: torch.Tensor, need_dx: bool, need_dw: bool,
                             block_n: int | None = None, programs: int | None = None) -> tuple:
    """``(dx, dweight)`` of :func:`rms_norm_forward_triton`, each None where not needed;
    ``dweight`` sums the float32 per-program sums, rounded once to ``weight``'s dtype.
    Rows up to 16384 wide are held whole (unless ``block_n`` asks for narrower tiles)."""
    require_triton("rms_norm_backward_triton")
    dy, x, w, n = grad_output.contiguous(), x.contiguous(), weight.contiguous(), weight.numel()
    m = _rows(x, n)
    dx = torch.empty_like(x, dtype=dy.dtype) if need_dx else None
    if not (need_dx or need_dw):
        return None, None
    if not m:
        return dx, (torch.zeros_like(weight) if need_dw else None)
    whole = triton.next_power_of_2(n)
    whole_row = (block_n is None or block_n >= whole) and n <= _WHOLE_ROW_MAX
    block_m, block_n = (1, whole) if whole_row else _blocks(n, block_n)
    programs = min(programs or _programs(m, x.device), triton.cdiv(m, block_m))
    rows_per_program = triton.cdiv(triton.cdiv(m, programs), block_m) * block_m
    programs = triton.cdiv(m, rows_per_program)
    partial = torch.empty((programs, n) if need_dw else (1,), device=x.device,
                          dtype=torch.float32)
    args = (dy, x, w, rstd.contiguous(), dx if need_dx else dy, partial, m, n)
    if whole_row:
        _rms_norm_bwd_row_kernel[(programs,)](
            *args, rows_per_program, NEED_DX=need_dx, NEED_DW=need_dw, BLOCK_N=block_n,
            num_warps=max(4, min(16, block_n // 512)))
    else:
        partial.zero_()
        _rms_norm_bwd_kernel[(programs,)](*args, rows_per_program, NEED_DX=need_dx,
                                          NEED_DW=need_dw, BLOCK_M=block_m, BLOCK_N=block_n)
    dw = partial.sum(0).view(weight.shape).to(weight.dtype) if need_dw else None
    return dx, dw
