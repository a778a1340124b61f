"""SwiGLU and the other gated linear units (GLU, GEGLU, QGEGLU, ReGLU, SReGLU), forward and
backward, one pass over memory each, float32 in registers only.

``x = [a | b]`` (each half ``N`` wide), ``y = gate(a) * b`` (``KINDS``: SwiGLU's gate is
``silu``). The forward reads ``x``
once and writes ``y``; the backward reads ``dy`` and ``x`` once and writes both halves
of ``dx``. When the neighbouring GEMM takes the result in FP8 (forward: the next
linear layer's input; backward: the previous one's output gradient), the result is
never written in high precision: a first pass computes it for its absolute maximum,
a second computes it again and writes the FP8 data and its transposed copy. The
values are rounded to the input dtype before the amax and the cast, so the bits are
those of the plain kernel followed by the FP8 cast.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl
from fusible.kernels.fp8_cast import (atomic_amax_of_tile, fp8_buffers, fp8_results,
                                      scale_from_amax, store_fp8_tile, tile_coords, tile_grid)


@jit
def _swiglu_tile(x_ptr, rows, cols, mask, N):
    """``(a, b)`` of the tile, float32."""
    offs = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
    a = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + offs + N, mask=mask, other=0.0).to(tl.float32)
    return a, b


KINDS = {"swiglu": 0, "geglu": 1, "glu": 2, "reglu": 3, "sreglu": 4, "qgeglu": 5}


@jit
def _gate(a, KIND: tl.constexpr):
    """``(gate(a), gate'(a))``."""
    if KIND == 1:  # tanh GELU; (1 + tanh u) / 2 = sigmoid(2u): no cancellation in the tails
        inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        sig = tl.sigmoid(2.0 * inner)
        return a * sig, sig + 2.0 * a * sig * (1.0 - sig) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * a * a)
    elif KIND == 2:  # sigmoid
        sig = tl.sigmoid(a)
        return sig, sig * (1.0 - sig)
    elif KIND == 3:  # ReLU
        return tl.maximum(a, 0.0), tl.where(a > 0.0, 1.0, 0.0)
    elif KIND == 4:  # squared ReLU
        r = tl.maximum(a, 0.0)
        return r * r, 2.0 * r
    else:  # KIND 5, quick GELU: a * sigmoid(1.702 a)
        sig = tl.sigmoid(1.702 * a)
        return a * sig, sig + 1.702 * a * sig * (1.0 - sig)


@jit
def _swiglu_values(a, b, KIND: tl.constexpr):
    if KIND == 0:
        return a * tl.sigmoid(a) * b
    g, _ = _gate(a, KIND)
    return g * b


@jit
def _swiglu_grads(dy, a, b, KIND: tl.constexpr):
    """``(da, db)``; for SwiGLU d silu(a) = sigmoid(a) (1 + a (1 - sigmoid(a)))."""
    if KIND == 0:
        sig = tl.sigmoid(a)
        return dy * b * sig * (1.0 + a * (1.0 - sig)), dy * a * sig
    g, dg = _gate(a, KIND)
    return dy * b * dg, dy * g


@jit
def _swiglu_fwd_kernel(x_ptr, y_ptr, amax_ptr, M, N, KIND: tl.constexpr,
                       AMAX_ONLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y`` (``M x N``), or (``AMAX_ONLY``) only the absolute maximum of its values."""
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    a, b = _swiglu_tile(x_ptr, rows, cols, mask, N)
    y = _swiglu_values(a, b, KIND).to(x_ptr.dtype.element_ty)
    if AMAX_ONLY:
        atomic_amax_of_tile(y.to(tl.float32), mask, amax_ptr)
    else:
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(y_ptr + offs, y, mask=mask)


@jit
def _swiglu_fwd_cast_kernel(x_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr, M, N,
                            FP8_MAX, KIND: tl.constexpr, HAS_T: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    a, b = _swiglu_tile(x_ptr, rows, cols, mask, N)
    y = _swiglu_values(a, b, KIND).to(x_ptr.dtype.element_ty).to(tl.float32)
    store_fp8_tile(y, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N,
                   FP8_MAX, HAS_T)


@jit
def _swiglu_bwd_kernel(dy_ptr, x_ptr, dx_ptr, amax_ptr, M, N, KIND: tl.constexpr,
                       AMAX_ONLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``dx`` (``M x 2N``), or (``AMAX_ONLY``) only the absolute maximum of its values."""
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    a, b = _swiglu_tile(x_ptr, rows, cols, mask, N)
    dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    da, db = _swiglu_grads(dy, a, b, KIND)
    da, db = da.to(dy_ptr.dtype.element_ty), db.to(dy_ptr.dtype.element_ty)
    if AMAX_ONLY:
        both = tl.maximum(tl.abs(da.to(tl.float32)), tl.abs(db.to(tl.float32)),
                          propagate_nan=tl.PropagateNan.ALL)
        atomic_amax_of_tile(both, mask, amax_ptr)
    else:
        offs = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
        tl.store(dx_ptr + offs, da, mask=mask)
        tl.store(dx_ptr + offs + N, db, mask=mask)


@jit
def _swiglu_bwd_cast_kernel(dy_ptr, x_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr,
                            M, N, FP8_MAX, KIND: tl.constexpr, HAS_T: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    a, b = _swiglu_tile(x_ptr, rows, cols, mask, N)
    dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    da, db = _swiglu_grads(dy, a, b, KIND)
    da = da.to(dy_ptr.dtype.element_ty).to(tl.float32)
    db = db.to(dy_ptr.dtype.element_ty).to(tl.float32)
    # dx is M x 2N: the two halves are column tiles of it
    store_fp8_tile(da, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M,
                   2 * N, FP8_MAX, HAS_T)
    store_fp8_tile(db, scale, rows, cols + N, mask, data_ptr, t_ptr, scale_inv_ptr, M,
                   2 * N, FP8_MAX, HAS_T)


def _rows_and_half(x: torch.Tensor, kind: str) -> tuple:
    if kind not in KINDS:
        raise ValueError(f"gated kind must be one of {list(KINDS)}, got {kind!r}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{kind} needs an even last dimension, got {tuple(x.shape)}")
    n = x.shape[-1] // 2
    return (x.numel() // x.shape[-1] if x.shape[-1] else 0), n


def swiglu_forward_triton(x: torch.Tensor, block_m: int = 32, block_n: int = 128,
                          kind: str = "swiglu"):
    """``gate(a) * b`` for ``a, b = x.chunk(2, -1)`` (SwiGLU: ``silu(a) * b``), in ``x``'s
    dtype."""
    require_triton("swiglu_forward_triton")
    x = x.contiguous()
    m, n = _rows_and_half(x, kind)
    y = x.new_empty((*x.shape[:-1], n))
    if y.numel():
        _swiglu_fwd_kernel[tile_grid(m, n, block_m, block_n)](
            x, y, y, m, n, KIND=KINDS[kind], AMAX_ONLY=False, BLOCK_M=block_m,
            BLOCK_N=block_n)
    return y


def swiglu_forward_fp8_triton(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                              columnwise: bool, block_m: int = 32, block_n: int = 128,
                              kind: str = "swiglu"):
    """``[data, scale_inv]`` (+ the transposed copy when ``columnwise``) of the forward's
    result in ``fp8_dtype`` with a current per-tensor scale, as the FP8 cast of
    :func:`swiglu_forward_triton`'s result would give."""
    require_triton("swiglu_forward_fp8_triton")
    x = x.contiguous()
    m, n = _rows_and_half(x, kind)
    if not m * n:
        raise ValueError(f"swiglu_forward_fp8_triton: empty input {tuple(x.shape)}")
    amax = torch.zeros((), device=x.device, dtype=torch.float32)
    grid = tile_grid(m, n, block_m, block_n)
    _swiglu_fwd_kernel[grid](x, amax, amax, m, n, KIND=KINDS[kind], AMAX_ONLY=True,
                             BLOCK_M=block_m, BLOCK_N=block_n)
    like = x.new_empty(()).expand(*x.shape[:-1], n)  # the result's shape, no memory
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(like, fp8_dtype, columnwise)
    _swiglu_fwd_cast_kernel[grid](x, amax, data, transpose, scale_inv, m, n, fp8_max,
                                  KIND=KINDS[kind], HAS_T=in_kernel_t, BLOCK_M=block_m,
                                  BLOCK_N=block_n)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)


def swiglu_backward_triton(grad_output: torch.Tensor, x: torch.Tensor, block_m: int = 32,
                           block_n: int = 128, kind: str = "swiglu"):
    """The gradient of :func:`swiglu_forward_triton` with respect to ``x``."""
    require_triton("swiglu_backward_triton")
    dy, x = grad_output.contiguous(), x.contiguous()
    m, n = _rows_and_half(x, kind)
    dx = torch.empty_like(x, dtype=dy.dtype)
    if dx.numel():
        _swiglu_bwd_kernel[tile_grid(m, n, block_m, block_n)](
            dy, x, dx, dx, m, n, KIND=KINDS[kind], AMAX_ONLY=False, BLOCK_M=block_m,
            BLOCK_N=block_n)
    return dx


def swiglu_backward_fp8_triton(grad_output: torch.Tensor, x: torch.Tensor,
                               fp8_dtype: torch.dtype, fp8_max: float, columnwise: bool,
                               block_m: int = 32, block_n: int = 128, kind: str = "swiglu"):
    """:func:`swiglu_backward_triton`'s result as :func:`swiglu_forward_fp8_triton` gives
    the forward's."""
    require_triton("swiglu_backward_fp8_triton")
    dy, x = grad_output.contiguous(), x.contiguous()
    m, n = _rows_and_half(x, kind)
    if not m * n:
        raise ValueError(f"swiglu_backward_fp8_triton: empty input {tuple(x.shape)}")
    amax = torch.zeros((), device=x.device, dtype=torch.float32)
    grid = tile_grid(m, n, block_m, block_n)
    _swiglu_bwd_kernel[grid](dy, x, amax, amax, m, n, KIND=KINDS[kind], AMAX_ONLY=True,
                             BLOCK_M=block_m, BLOCK_N=block_n)
    like = dy.new_empty(()).expand(x.shape)
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(like, fp8_dtype, columnwise)
    _swiglu_bwd_cast_kernel[grid](dy, x, amax, data, transpose, scale_inv, m, n, fp8_max,
                                  KIND=KINDS[kind], HAS_T=in_kernel_t, BLOCK_M=block_m,
                                  BLOCK_N=block_n)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)
