"""FP8 casts with one scale per row (row-wise current scaling), the transposed copy scaled
per row of its own layout.

On CUDA Triton kernels (``fusible.kernels.fp8_rowwise``: the data alone in one, both
layouts in two); elsewhere PyTorch ops, the same bits.
"""

from __future__ import annotations

import math

import torch

from fusible.core.inductor_fallbacks import ensure_fallback
from fusible.kernels import fp8_cast, fp8_rowwise, plain_eager
from fusible.quantization.casts.common import FP8_MAX, check_cast, pack_parts, unpack_parts
from fusible.quantization.casts.tensorwise import cast_tensorwise_torch


def cast_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = True,
                 columnwise: bool = False, column_amax: torch.Tensor | None = None) -> list:
    """Cast ``x``, seen as (tokens, features), to FP8 with one scale per row.

    Each row follows :func:`~fusible.quantization.casts.common.scale_from_amax`'s rules
    with its own amax (a NaN stays in its row).

    Parameters
    ----------
    x : Tensor
        Any shape, seen as (tokens, features).
    fp8_dtype : torch.dtype
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    rowwise : bool
        Write the data, scaled per token.
    columnwise : bool
        Write the (features, tokens) row-major copy, scaled per row of its own layout
        (per feature): what a GEMM contracting over the tokens needs.
    column_amax : Tensor, optional
        float32, (features,): replaces the copy's own maxima (the maxima over a process
        group, so that every rank casts its tokens with the group's scales).

    Returns
    -------
    list
        ``[data, scale_inv, transpose, transpose_scale_inv]``, None where not asked for:
        ``data`` of ``x``'s shape, ``scale_inv`` (tokens, 1), ``transpose`` (features,
        tokens), ``transpose_scale_inv`` (features, 1); float32 scales.

    Notes
    -----
    Where something may be tracing, it runs as the custom op
    ``fusible::cast_to_fp8_rowwise``.
    """
    check_cast("cast_to_fp8_rowwise", fp8_dtype, rowwise, columnwise)
    if not plain_eager(x) or (column_amax is not None and not plain_eager(column_amax)):
        # traced: the op (its fake gives the shapes, no kernel launch)
        flat = _OP(x, fp8_dtype, rowwise, columnwise, column_amax)
        return unpack_parts(flat, rowwise, columnwise)
    return _cast_rowwise(x, fp8_dtype, rowwise, columnwise, column_amax)


def _cast_rowwise(x, fp8_dtype, rowwise, columnwise, column_amax=None) -> list:
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if columnwise and x.is_cuda and fp8_cast.triton is not None:  # both layouts, two reads
        out = fp8_rowwise.cast_rows_and_columns_triton(x2, fp8_dtype, FP8_MAX[fp8_dtype],
                                                       rowwise, column_amax=column_amax)
        if rowwise:
            out[0] = out[0].view(x.shape)
        return out
    out = [None] * 4
    if rowwise:
        data, out[1] = _cast_rows(x2, fp8_dtype)
        out[0] = data.view(x.shape)
    if columnwise:
        out[2], out[3] = _cast_rows(x2.t(), fp8_dtype,
                                    None if column_amax is None else column_amax.view(-1, 1))
    return out


def _cast_rows(x2: torch.Tensor, fp8_dtype: torch.dtype, amax=None) -> tuple:
    """The rows of ``x2`` cast by their own maxima (or by ``amax``, (rows, 1))."""
    if x2.is_cuda and fp8_cast.triton is not None and amax is None:
        return fp8_rowwise.cast_rows_triton(x2, fp8_dtype, FP8_MAX[fp8_dtype])
    xf = x2.float().contiguous()
    if amax is None:
        amax = xf.abs().amax(1, keepdim=True) if xf.shape[1] else xf.new_zeros((xf.shape[0], 1))
    data, scale_inv = cast_tensorwise_torch(xf, fp8_dtype, False, amax)
    return data, scale_inv


# torch.library.Library rather than torch.library.custom_op: see casts/tensorwise.py.
_LIB = torch.library.Library("fusible", "FRAGMENT")
_LIB.define("cast_to_fp8_rowwise(Tensor x, ScalarType fp8_dtype, bool rowwise, bool columnwise, "
            "Tensor? column_amax=None) -> Tensor[]")
_LIB.impl("cast_to_fp8_rowwise", lambda *args: pack_parts(_cast_rowwise(*args)),
          "CompositeExplicitAutograd")


@torch.library.register_fake("fusible::cast_to_fp8_rowwise", lib=_LIB)
def _(x, fp8_dtype, rowwise, columnwise, column_amax=None):
    ensure_fallback(torch.ops.fusible.cast_to_fp8_rowwise.default)  # (see core.inductor_fallbacks)
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    out = []
    if rowwise:
        out += [x.new_empty(x.shape, dtype=fp8_dtype),
                x.new_empty((rows, 1), dtype=torch.float32)]
    if columnwise:
        out += [x.new_empty((cols, rows), dtype=fp8_dtype),
                x.new_empty((cols, 1), dtype=torch.float32)]
    return out


_OP = torch.ops.fusible.cast_to_fp8_rowwise.default
