"""Grouped GEMMs in Triton, for GPUs and dtypes ``torch._grouped_mm`` does not take
(fusible.functional.grouped): the groups' sizes are read on the device, so there is no
host synchronisation, and an empty group costs nothing (its weight gradient is zeros).

- :func:`grouped_mm_triton`: ``y[group g's rows] = x[those rows] @ w[g].T`` (the forward;
  dgrad is the same with each group's weight transposed, a strided view).
- :func:`grouped_wgrad_triton`: ``dw[g] = dy[group g's rows].T @ x[those rows]``.

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
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, ends_ptr, G, N, K, stride_wg, stride_wn,
                       stride_wk, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < end) & (cols[None, :] < N))


@jit
def _grouped_wgrad_kernel(dy_ptr, x_ptr, dw_ptr, ends_ptr, N, K, IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    group = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    ns = (tl.program_id(1) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (tl.program_id(1) // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    end = tl.load(ends_ptr + group).to(tl.int32)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        a = tl.load(dy_ptr + rows[None, :].to(tl.int64) * N + ns[:, None],
                    mask=(rows[None, :] < end) & (ns[:, None] < N), other=0.0)
        b = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)
        acc += _dot(a, b, IEEE)
    tl.store(dw_ptr + group.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=(ns[:, None] < N) & (ks[None, :] < K))


def _ends(splits: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(splits, 0, dtype=torch.int32)


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, splits: torch.Tensor,
                      block_m: int = 64, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """``y[group g's rows] = x[those rows] @ w[g].T``: ``x`` (rows, k) contiguous, ``w``
    (groups, n, k) with any strides (a transposed view for dgrad), ``splits`` the groups'
    sizes on the device; ``y`` in ``x``'s dtype."""
    require_triton("grouped_mm_triton")
    x = x.contiguous()
    groups, n, k = w.shape
    y = x.new_empty((x.shape[0], n))
    if not (x.shape[0] and n):
        return y
    grid = (triton.cdiv(x.shape[0], block_m) + groups, triton.cdiv(n, block_n))
    _grouped_mm_kernel[grid](x, w, y, _ends(splits), groups, n, k, *w.stride(),
                             IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def grouped_wgrad_triton(dy: torch.Tensor, x: torch.Tensor, splits: torch.Tensor,
                         groups: int, block_m: int = 32, block_n: int = 64,
                         block_k: int = 64) -> torch.Tensor:
    """``dw[g] = dy[group g's rows].T @ x[those rows]`` (zeros for an empty group), shape
    (groups, n, k), in ``dy``'s dtype."""
    require_triton("grouped_wgrad_triton")
    dy, x = dy.contiguous(), x.contiguous()
    n, k = dy.shape[1], x.shape[1]
    dw = dy.new_empty((groups, n, k))
    if not (n and k):
        return dw
    grid = (groups, triton.cdiv(n, block_n) * triton.cdiv(k, block_k))
    _grouped_wgrad_kernel[grid](dy, x, dw, _ends(splits), n, k, IEEE=dy.dtype == torch.float32,
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return dw
