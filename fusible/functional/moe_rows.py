"""The two row moves of token routing (:mod:`fusible.moe`), forward and backward:

- :func:`gather_rows`: each output row a scaled copy of one source row, or zeros
  (tokens to the experts' rows, padding included; the combine's gradient back to them);
- :func:`combine_rows`: each output row a weighted sum of ``k`` source rows (the
  experts' outputs back to their tokens; the permutation's gradient).

Both in float32, rounded once; a sum in ``j`` order. On CUDA one Triton kernel each
(:mod:`fusible.kernels.moe_rows`), elsewhere the same arithmetic in PyTorch. Custom ops
(``fusible::gather_rows``, ``fusible::combine_rows``): a compiled layer runs the same
kernels as an eager one (the same bits), and Inductor sees no data-dependent gather.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible.core.inductor_fallbacks import ensure_fallback
from fusible.kernels import moe_rows, plain_eager, triton_can_run

Tensor = torch.Tensor


def gather_rows(src: Tensor, row_copy: Tensor, k: int, copy_scales: Optional[Tensor] = None,
                dots_with: Optional[Tensor] = None) -> tuple:
    """``(out, dots)``: ``out[r] = copy_scales[c] * src[c // k]`` for the copy ``c =
    row_copy[r]``, a zero row where ``c < 0`` (``copy_scales`` None: 1); with ``dots_with``
    (shaped like ``out``) also ``dots[c] = sum(src[c // k] * dots_with[r])``, float32, zero
    for copies no row holds (``dots`` None without it)."""
    tensors = [t for t in (src, copy_scales, dots_with) if t is not None]
    if plain_eager(src, row_copy, *tensors):
        return _gather_rows_impl(src, row_copy, k, copy_scales, dots_with)
    out, dots = torch.ops.fusible.gather_rows(src, row_copy, k, copy_scales, dots_with)
    return out, dots if dots_with is not None else None


def combine_rows(src: Tensor, copy_row: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """``out[t] = sum_j weights[t, j] * src[copy_row[t, j]]`` (``copy_row`` (tokens, k);
    rows ``< 0`` left out; ``weights`` None: 1)."""
    if plain_eager(src, copy_row, *([weights] if weights is not None else [])):
        return _combine_rows_impl(src, copy_row, weights)
    return torch.ops.fusible.combine_rows(src, copy_row, weights)


def inverse_permutation(index: Tensor) -> Tensor:
    """The inverse of ``index``, a permutation of ``0..n-1`` (in its dtype)."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device, dtype=index.dtype)
    return inverse


def _gather_rows_impl(src, row_copy, k, copy_scales, dots_with):
    if triton_can_run(src, *[t for t in (copy_scales, dots_with) if t is not None]):
        return moe_rows.gather_rows_triton(src, row_copy, k, copy_scales, dots_with)
    acc = torch.promote_types(src.dtype, torch.float32)
    if src.shape[0] == 0:  # no token: every row is padding (no copy to read)
        out = src.new_zeros((row_copy.shape[0], src.shape[1]))
        return out, (None if dots_with is None else
                     torch.zeros(0, dtype=torch.float32, device=src.device))
    valid = row_copy >= 0
    copy = row_copy.clamp(min=0)
    values = src.index_select(0, copy // k).to(acc)
    scale = valid.to(acc) if copy_scales is None else \
        torch.where(valid, copy_scales.index_select(0, copy).to(acc), 0)
    out = (values * scale[:, None]).to(src.dtype)
    if dots_with is None:
        return out, None
    # kept rows hold distinct copies: an exact scatter
    row_dots = torch.where(valid, (values * dots_with.to(acc)).sum(1), 0).float()
    dots = torch.zeros(copy_scales.numel() + 1, dtype=torch.float32, device=src.device)
    dots.index_copy_(0, torch.where(valid, copy, copy_scales.numel()), row_dots)
    return out, dots[:-1]


def _combine_rows_impl(src, copy_row, weights):
    if copy_row.dim() == 1:  # one copy per token (a 0-token batch must keep its k)
        copy_row = copy_row[:, None]
    if triton_can_run(src, *([weights] if weights is not None else [])):
        return moe_rows.combine_rows_triton(src, copy_row, weights)
    acc_dtype = torch.promote_types(src.dtype, torch.float32)
    acc = src.new_zeros((copy_row.shape[0], src.shape[1]), dtype=acc_dtype)
    for j in range(copy_row.shape[1]):
        row = copy_row[:, j]
        scale = (row >= 0).to(acc_dtype)
        if weights is not None:
            scale = scale * weights[:, j].to(acc_dtype)
        acc = acc + src.index_select(0, row.clamp(min=0)).to(acc_dtype) * scale[:, None]
    return acc.to(src.dtype)


@torch.library.custom_op("fusible::gather_rows", mutates_args=())
def _gather_rows_op(src: Tensor, row_copy: Tensor, k: int, copy_scales: Optional[Tensor],
                    dots_with: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    out, dots = _gather_rows_impl(src, row_copy, k, copy_scales, dots_with)
    return out, dots if dots is not None else src.new_empty(0, dtype=torch.float32)


@_gather_rows_op.register_fake
def _(src, row_copy, k, copy_scales, dots_with):
    ensure_fallback(torch.ops.fusible.gather_rows.default)
    dots = 0 if dots_with is None else copy_scales.shape[0]
    return (src.new_empty((row_copy.shape[0], src.shape[1])),
            src.new_empty(dots, dtype=torch.float32))


@torch.library.custom_op("fusible::combine_rows", mutates_args=())
def _combine_rows_op(src: Tensor, copy_row: Tensor, weights: Optional[Tensor]) -> Tensor:
    return _combine_rows_impl(src, copy_row, weights)


@_combine_rows_op.register_fake
def _(src, copy_row, weights):
    ensure_fallback(torch.ops.fusible.combine_rows.default)
    return src.new_empty((copy_row.shape[0], src.shape[1]))
