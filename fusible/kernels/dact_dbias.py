"""Activation gradient fused with the bias gradient (the sum of that gradient over tokens).

On CUDA, for large tensors, one Triton kernel reads ``dy`` and the saved tensor
once, writes ``dact`` and per-chunk column sums; a small second reduction over
the chunks gives ``dbias`` (deterministic: no atomics). Elsewhere, and for
small tensors, two PyTorch ops do it (``fusible.functional.activations.dact_dbias``
chooses).

When the next stage takes the gradient in FP8, the Triton version never writes
``dact`` in high precision: a first pass computes it for its absolute maximum and
the column sums, a second computes it again and writes the FP8 data and its
transposed copy. Same bits as the Triton ``dact`` followed by the FP8 cast.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible.kernels import jit, require_triton, tl, triton
from fusible.kernels.fp8_cast import (fp8_buffers, fp8_results, max_keep_nan, scale_from_amax,
                                      store_fp8_tile, tile_coords, tile_grid, zeroed_amax)
from fusible.kernels.fp8_delayed import DelayedCast, finish, kernel_args, record_delayed

KINDS = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}


# Below this many elements the pass the Triton kernel saves (under 10 us of HBM traffic
# on an H200) is worth less than its extra host work (launcher, buffer, second
# reduction: about 65 us more than the PyTorch ops, measured on an H200 host), and
# such small steps are bound by host time.
TRITON_MIN_NUMEL = 1 << 24


@jit
def _activation_grad(dy, s, KIND: tl.constexpr):
    if KIND == 0:  # exact GELU; s is the input
        cdf = 0.5 * (1.0 + tl.erf(s * 0.7071067811865476))
        pdf = tl.exp(-0.5 * s * s) * 0.3989422804014327
        return dy * (cdf + s * pdf)
    elif KIND == 1:  # tanh GELU; s is the input
        # (1 + tanh(u)) / 2 = sigmoid(2u) and 1 - tanh(u)^2 = 4 sigmoid(2u)(1 - sigmoid(2u)):
        # no cancellation in the tails.
        inner = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        sig = tl.sigmoid(2.0 * inner)
        d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * s * s)
        return dy * (sig + 2.0 * s * sig * (1.0 - sig) * d_inner)
    elif KIND == 2:  # ReLU; s is the output
        return tl.where(s > 0.0, dy, 0.0)
    else:  # SiLU; s is the input
        sig = tl.sigmoid(s)
        return dy * sig * (1.0 + s * (1.0 - sig))


@jit
def _dact_dbias_kernel(dy_ptr, s_ptr, dact_ptr, partial_ptr, amax_ptr, M, N,
                       KIND: tl.constexpr, KEEP_AMAX: tl.constexpr,
                       ROWS_PER_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Column sums of the rounded ``dact``, and ``dact`` itself or (``KEEP_AMAX``, the
    first FP8 pass) only its absolute maximum. The sums and the maximum stay whole tiles,
    reduced over rows once at the end: a cross-warp reduction per step cost the FP8
    GELU backward 20-30% of its time on an H200 (diagnostics/activation_tiles.py)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    amax = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, ROWS_PER_PROGRAM, BLOCK_M):
        rows = pid_m * ROWS_PER_PROGRAM + start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & col_ok[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d_out = _activation_grad(dy, s, KIND).to(dy_ptr.dtype.element_ty)
        d = tl.where(mask, d_out.to(tl.float32), 0.0)
        acc += d
        if KEEP_AMAX:
            amax = tl.maximum(amax, tl.abs(d), propagate_nan=tl.PropagateNan.ALL)
        else:
            tl.store(dact_ptr + offs, d_out, mask=mask)
    tl.store(partial_ptr + pid_m.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)
    if KEEP_AMAX:
        tl.atomic_max(amax_ptr, tl.reduce(tl.reduce(amax, 0, max_keep_nan), 0, max_keep_nan))


@jit
def _dact_cast_kernel(dy_ptr, s_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr, M, N,
                      FP8_MAX, state_ptr, ticket_ptr, MARGIN_FACTOR, KIND: tl.constexpr,
                      HAS_T: tl.constexpr, DELAYED: tl.constexpr, ROLL: tl.constexpr,
                      MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = _activation_grad(dy, s, KIND).to(dy_ptr.dtype.element_ty).to(tl.float32)
    store_fp8_tile(d, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N,
                   FP8_MAX, HAS_T)
    if DELAYED:
        record_delayed(d, mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL, MOST_RECENT,
                       HISTORY, BLOCK_H)


def dact_dbias_triton(kind: str, grad_output: torch.Tensor, saved: torch.Tensor,
                      rows_per_program: int = 256, block_m: int = 16, block_n: int = 128):
    """The Triton version; ``dbias`` sums the rounded ``dact`` as the PyTorch version does."""
    require_triton("dact_dbias_triton")
    if grad_output.shape != saved.shape:
        raise ValueError(f"dact_dbias: grad_output {tuple(grad_output.shape)} and saved "
                         f"{tuple(saved.shape)} differ")
    dy = grad_output.contiguous()
    s = saved.contiguous()
    n = dy.shape[-1]
    m = dy.numel() // n
    dact = torch.empty_like(dy)
    if m == 0:
        return dact, torch.zeros(n, device=dy.device, dtype=dy.dtype)
    chunks = triton.cdiv(m, rows_per_program)
    partial = torch.empty(chunks, n, device=dy.device, dtype=torch.float32)
    grid = (chunks, triton.cdiv(n, block_n))
    _dact_dbias_kernel[grid](dy, s, dact, partial, partial, m, n, KIND=KINDS[kind],
                             KEEP_AMAX=False, ROWS_PER_PROGRAM=rows_per_program,
                             BLOCK_M=block_m, BLOCK_N=block_n)
    return dact, partial.sum(0).to(dy.dtype)


def dact_dbias_fp8_triton(kind: str, grad_output: torch.Tensor, saved: torch.Tensor,
                          fp8_dtype: torch.dtype, fp8_max: float, columnwise: bool,
                          delayed: Optional[DelayedCast] = None, rows_per_program: int = 256,
                          block_m: int = 16, block_n: int = 128, cast_block_m: int = 32,
                          cast_block_n: int = 128):
    """``(data, scale_inv, transposed copy or None, dbias)``: :func:`dact_dbias_triton`
    followed by the FP8 cast of ``dact`` to ``fp8_dtype`` (largest value ``fp8_max``),
    without writing ``dact`` in high precision; scaled by ``delayed``'s state where
    given (its amax recorded by the cast)."""
    require_triton("dact_dbias_fp8_triton")
    if grad_output.shape != saved.shape or grad_output.numel() == 0:
        raise ValueError(f"dact_dbias_fp8: grad_output {tuple(grad_output.shape)} and saved "
                         f"{tuple(saved.shape)} must match and not be empty")
    dy, s = grad_output.contiguous(), saved.contiguous()
    n = dy.shape[-1]
    m = dy.numel() // n
    chunks = triton.cdiv(m, rows_per_program)
    partial = torch.empty(chunks, n, device=dy.device, dtype=torch.float32)
    amax = zeroed_amax(dy.device)
    _dact_dbias_kernel[(chunks, triton.cdiv(n, block_n))](  # dact_ptr: unused
        dy, s, partial, partial, amax, m, n, KIND=KINDS[kind], KEEP_AMAX=True,
        ROWS_PER_PROGRAM=rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n)
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(dy, fp8_dtype, columnwise)
    if delayed is not None:  # the first pass still sums dbias
        amax = delayed.state
    _dact_cast_kernel[tile_grid(m, n, cast_block_m, cast_block_n)](
        dy, s, amax, data, transpose, scale_inv, m, n, fp8_max, **kernel_args(delayed, amax),
        KIND=KINDS[kind], HAS_T=in_kernel_t, BLOCK_M=cast_block_m, BLOCK_N=cast_block_n)
    finish(delayed)
    data, scale_inv, *transpose = fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)
    return data, scale_inv, (transpose[0] if transpose else None), partial.sum(0).to(dy.dtype)
