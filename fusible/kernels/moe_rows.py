"""Token routing's row moves (:mod:`fusible.functional.moe_rows`): each output row is
read from its source rows and written once, so a permutation, its padding and the
router's weighting are one pass over memory (PyTorch's ops take a pass each: gather,
pad, scatter, multiply, sum). One program per output row, its columns in blocks;
float32 in registers, the sums in a fixed order (deterministic, no atomics).
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl, triton

_BLOCK = 1024  # columns per step: 2 KiB of bf16 per load, 4 warps


@jit
def _gather_rows_kernel(src_ptr, row_copy_ptr, scale_ptr, other_ptr, out_ptr, dots_ptr, H, K,
                        HAS_SCALE: tl.constexpr, HAS_DOTS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[r] = scale[c] * src[c // K]`` for ``c = row_copy[r]`` (zeros where ``c < 0``);
    ``HAS_DOTS``: ``dots[c] = sum(src[c // K] * other[r])`` too."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.load(row_copy_ptr + r)
    valid = c >= 0
    c_or_0 = tl.where(valid, c, 0)
    src_row = src_ptr + (c_or_0 // K) * H
    src_cols = tl.where(valid, H, 0)  # a zero row: no column read
    scale = 1.0
    if HAS_SCALE:
        # masked: a padding row has no copy, and without tokens there is no scale at all
        scale = tl.load(scale_ptr + c_or_0, mask=valid, other=0.0).to(tl.float32)
    dots = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < H
        v = tl.load(src_row + cols, mask=cols < src_cols, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * H + cols, (v * scale).to(out_ptr.dtype.element_ty), mask=in_row)
        if HAS_DOTS:
            dots += v * tl.load(other_ptr + r * H + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_DOTS:
        if valid:
            tl.store(dots_ptr + c, tl.sum(dots, 0))


@jit
def _combine_rows_kernel(src_ptr, copy_row_ptr, weight_ptr, out_ptr, H,
                         K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = sum_j weight[t, j] * src[copy_row[t, j]]`` in ``j`` order (rows ``< 0``
    left out)."""
    t = tl.program_id(0).to(tl.int64)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(copy_row_ptr + t * K + j)
            v = tl.load(src_ptr + tl.where(row >= 0, row, 0) * H + cols,
                        mask=cols < tl.where(row >= 0, H, 0), other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                v = v * tl.load(weight_ptr + t * K + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


def gather_rows_triton(src: torch.Tensor, row_copy: torch.Tensor, k: int,
                       copy_scales=None, dots_with=None) -> tuple:
    """``(out, dots)`` of :func:`fusible.functional.moe_rows.gather_rows` (``dots`` None
    without ``dots_with``)."""
    require_triton("gather_rows")
    rows, h = row_copy.numel(), src.shape[1]
    out = src.new_empty((rows, h))
    dots = None
    if dots_with is not None:
        dots = torch.zeros(copy_scales.numel(), dtype=torch.float32, device=src.device)
    if rows:
        _gather_rows_kernel[(rows,)](
            src, row_copy, copy_scales if copy_scales is not None else src,
            dots_with if dots_with is not None else src, out,
            dots if dots is not None else out, h, k, HAS_SCALE=copy_scales is not None,
            HAS_DOTS=dots_with is not None, BLOCK=_block(h), num_warps=4)
    return out, dots


def combine_rows_triton(src: torch.Tensor, copy_row: torch.Tensor, weights=None):
    """:func:`fusible.functional.moe_rows.combine_rows` (``copy_row`` (tokens, k))."""
    require_triton("combine_rows")
    tokens, k = copy_row.shape
    out = src.new_empty((tokens, src.shape[1]))
    if tokens:
        _combine_rows_kernel[(tokens,)](
            src, copy_row, weights if weights is not None else src, out, src.shape[1],
            K=k, HAS_WEIGHTS=weights is not None, BLOCK=_block(src.shape[1]),
            num_warps=4)
    return out


def _block(columns: int) -> int:
    return min(_BLOCK, triton.next_power_of_2(max(columns, 1)))
