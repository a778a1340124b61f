"""Grouped GEMMs in Triton, for GPUs and dtypes ``torch._grouped_mm`` does not take
(fusible.functional.grouped): the groups' sizes are read on the device, so there is no
host synchronisation, and an empty group costs nothing (its weight gradient is zeros).

- :func:`grouped_mm_triton`: ``y[group g's rows] = x[those rows] @ w[g].T`` (the forward;
  dgrad is the same with each group's weight transposed, a strided view).
- :func:`grouped_wgrad_triton`: ``dw[g] = dy[group g's rows].T @ x[those rows]``.

Both take FP8 operands with their scales too (the FP8 grouped GEMMs of GPUs without
``torch._scaled_grouped_mm``, and an alternative to it on Hopper).

The forward grid has one program per row tile of each group (an upper bound of
``cdiv(rows, BLOCK_M) + groups`` tiles, the surplus ones returning at once) and column
tile; a program finds its group by walking the groups' tile counts. Float32 operands are
multiplied in IEEE float32 (no TF32, as PyTorch's default), every sum accumulates in
float32 and is rounded once.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl, triton


@jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@jit
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, ends_ptr, sx_ptr, sw_ptr, G, N, K, stride_wg,
                       stride_wn, stride_wk, IEEE: tl.constexpr, SCALED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    zero = tl.zeros((), dtype=tl.int32)  # typed loop-carried scalars
    group, start, end, first_tile, prev_end = zero - 1, zero, zero, zero, zero
    for g in range(0, G):  # the group whose row tiles hold this program's
        g_end = tl.load(ends_ptr + g).to(tl.int32)
        tiles = tl.cdiv(g_end - prev_end, BLOCK_M)
        hit = (group < 0) & (tile < first_tile + tiles)
        group = tl.where(hit, g, group)
        start = tl.where(hit, prev_end + (tile - first_tile) * BLOCK_M, start)
        end = tl.where(hit, g_end, end)
        first_tile += tiles
        prev_end = g_end
    if group >= 0:
        rows = start + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + group.to(tl.int64) * stride_wg
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                        mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)
            b = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn
                        + ks[:, None].to(tl.int64) * stride_wk,
                        mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
            acc += _dot(a, b, IEEE)
        if SCALED:  # FP8 operands: x's one scale, this group's weight scale
            acc = acc * (tl.load(sx_ptr) * tl.load(sw_ptr + group))
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < end) & (cols[None, :] < N))


@jit
def _grouped_wgrad_kernel(dy_ptr, x_ptr, dw_ptr, ends_ptr, sdy_ptr, sx_ptr, N, K, stride_dym,
                          stride_dyn, stride_xm, stride_xk, IEEE: tl.constexpr,
                          SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """``dy`` (rows, N) and ``x`` (rows, K) by strides: row-major, or (FP8) the views of
    their transposed copies, where the rows are the contiguous dimension."""
    group = tl.program_id(1)  # the tiles on axis 0: CUDA caps axis 1 at 65535 programs
    tiles_n = tl.cdiv(N, BLOCK_N)
    ns = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (tl.program_id(0) // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    end = tl.load(ends_ptr + group).to(tl.int32)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        a = tl.load(dy_ptr + rows[None, :].to(tl.int64) * stride_dym
                    + ns[:, None].to(tl.int64) * stride_dyn,
                    mask=(rows[None, :] < end) & (ns[:, None] < N), other=0.0)
        b = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm
                    + ks[None, :].to(tl.int64) * stride_xk,
                    mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)
        acc += _dot(a, b, IEEE)
    if SCALED:
        acc = acc * (tl.load(sdy_ptr) * tl.load(sx_ptr))
    tl.store(dw_ptr + group.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=(ns[:, None] < N) & (ks[None, :] < K))


def group_ends(splits: torch.Tensor) -> torch.Tensor:
    """The groups' end offsets, int32: what these kernels and ``torch._grouped_mm`` take."""
    return torch.cumsum(splits, 0, dtype=torch.int32)


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, splits: torch.Tensor,
                      block_m: int = 64, block_n: int = 64, block_k: int = 32, *,
                      scales: tuple = (), out_dtype=None, num_warps: int = 4) -> torch.Tensor:
    """``y[group g's rows] = x[those rows] @ w[g].T``: ``x`` (rows, k) contiguous, ``w``
    (groups, n, k) with any strides (a transposed view for dgrad), ``splits`` the groups'
    sizes on the device; ``y`` in ``x``'s dtype. FP8 operands: ``scales = (x_scale_inv,
    w_scale_inv)`` (one for ``x``, one per group) multiply the sums, ``y`` in
    ``out_dtype``."""
    require_triton("grouped_mm_triton")
    x = x.contiguous()
    groups, n, k = w.shape
    y = x.new_empty((x.shape[0], n), dtype=out_dtype or x.dtype)
    if not (x.shape[0] and n):
        return y
    sx, sw = scales or (y, y)  # unused pointers without scales
    grid = (triton.cdiv(x.shape[0], block_m) + groups, triton.cdiv(n, block_n))
    _grouped_mm_kernel[grid](x, w, y, group_ends(splits), sx, sw, groups, n, k, *w.stride(),
                             IEEE=x.dtype == torch.float32, SCALED=bool(scales),
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             num_warps=num_warps)
    return y


def grouped_wgrad_triton(dy: torch.Tensor, x: torch.Tensor, splits: torch.Tensor,
                         groups: int, block_m: int = 32, block_n: int = 64,
                         block_k: int = 64, *, scales: tuple = (),
                         out_dtype=None, num_warps: int = 4) -> torch.Tensor:
    """``dw[g] = dy[group g's rows].T @ x[those rows]`` (zeros for an empty group), shape
    (groups, n, k), in ``dy``'s dtype. ``dy`` and ``x`` with any strides (FP8: the ``.t()``
    views of their transposed copies), FP8 with ``scales = (dy_scale_inv, x_scale_inv)``
    and ``out_dtype``."""
    require_triton("grouped_wgrad_triton")
    n, k = dy.shape[1], x.shape[1]
    dw = dy.new_empty((groups, n, k), dtype=out_dtype or dy.dtype)
    if not (n and k):
        return dw
    sdy, sx = scales or (dw, dw)
    grid = (triton.cdiv(n, block_n) * triton.cdiv(k, block_k), groups)
    _grouped_wgrad_kernel[grid](dy, x, dw, group_ends(splits), sdy, sx, n, k, *dy.stride(),
                                *x.stride(), IEEE=dy.dtype == torch.float32,
                                SCALED=bool(scales), BLOCK_M=block_m, BLOCK_N=block_n,
                                BLOCK_K=block_k, num_warps=num_warps)
    return dw
