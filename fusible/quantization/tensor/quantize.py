"""Quantizing into Float8Tensors: from a tensor with per-tensor current scaling or with
any scaling, from the parts a cast kernel returns, from a transposed copy alone, and
into another FP8 dtype or layout."""

from __future__ import annotations

from typing import Optional

import torch

from fusible.quantization.casts.tensorwise import cast_tensorwise
from fusible.quantization.scalings.base import Scaling, scaling_named, scaling_of
from fusible.quantization.tensor.float8_tensor import Float8Tensor


def from_cast_parts(parts: list, dtype: torch.dtype) -> Float8Tensor:
    """The Float8Tensor of a cast kernel's ``[data, scale_inv] (+ transposed copy)``,
    dequantizing to ``dtype``."""
    data, scale_inv, *transpose = parts
    return Float8Tensor(data, scale_inv, dtype, transpose[0] if transpose else None)


def transposed_only(transpose: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                    shape=None) -> Float8Tensor:
    """A Float8Tensor holding only the transposed copy (its data is a view of it, in
    ``shape``, default 2-D): what the backward GEMMs read of a saved input or weight, at
    half the memory."""
    data = transpose.t()
    if scale_inv.dim():  # the copy's own scales: seen transposed, the data's
        if shape is not None and len(shape) != 2 and tuple(scale_inv.shape) != (data.shape[1], 1):
            raise NotImplementedError(f"a {len(shape)}-D FP8 tensor held by a transposed copy "
                                      f"with block scales {tuple(scale_inv.shape)}")
        scales = scale_inv.t() if shape is None or len(shape) == 2 else \
            per_column_scales(scale_inv.t(), shape)  # per-row copy scales: per column, N-D
        return Float8Tensor(data if shape is None else data.view(shape), scales, dtype,
                            transpose, transpose_scale_inv=scale_inv)
    return Float8Tensor(data if shape is None else data.view(shape), scale_inv, dtype, transpose)


def quantize_raw(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                 dtype: Optional[torch.dtype] = None,
                 amax: Optional[torch.Tensor] = None, rowwise: bool = True) -> Float8Tensor:
    """Quantize with current scaling (the ``fusible::cast_to_fp8`` custom op's kernel);
    ``amax`` replaces ``x``'s own absolute maximum (see
    :func:`~fusible.quantization.casts.tensorwise.cast_tensorwise`). Without ``rowwise``
    only the transposed copy is kept (the data is a view of it)."""
    out = cast_tensorwise(x, fp8_dtype, columnwise, amax, rowwise)
    if not rowwise:
        return transposed_only(out[0], out[1], dtype or x.dtype, x.shape)
    return Float8Tensor(out[0], out[1], dtype or x.dtype, out[2] if columnwise else None)


def quantize_scaled(x: torch.Tensor, scaling: Scaling, fp8_dtype: torch.dtype,
                    columnwise: bool = False, dtype: Optional[torch.dtype] = None,
                    state: Optional[torch.Tensor] = None) -> Float8Tensor:
    """``x`` (..., features) quantized with ``scaling`` (seen as (tokens, features));
    ``columnwise``: with the (features, tokens) copy scaled per block of its own layout.
    Scales per row (or per tile of a row) keep ``x``'s leading dimensions (``(..., rows,
    1)``, ``(..., rows, tiles)``); blocks of several rows need a 2-D ``x``. ``state``: a
    stateful scaling's (updated by the cast)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    data, scale_inv, transpose, t_scale_inv = scaling.cast(x2, fp8_dtype, True, columnwise,
                                                           state=state)
    if x.dim() != 2 and scale_inv.dim():
        if scale_inv.shape[0] != x2.shape[0]:
            raise NotImplementedError(f"{scaling.name} FP8 scaling of a {x.dim()}-D tensor of "
                                      f"shape {tuple(x.shape)}: its blocks span rows; quantize "
                                      f"it as (tokens, features)")
        scale_inv = scale_inv.view(*x.shape[:-1], scale_inv.shape[-1])
    return Float8Tensor(data.view(x.shape), scale_inv, dtype or x.dtype, transpose,
                        transpose_scale_inv=t_scale_inv)


def quantize_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                     dtype: Optional[torch.dtype] = None) -> Float8Tensor:
    """``x`` (..., features) quantized with one scale per row (``scale_inv`` of shape
    ``x.shape[:-1] + (1,)``); ``columnwise``: with the (features, tokens) copy scaled per
    row of its own layout (:func:`~fusible.quantization.casts.rowwise.cast_rowwise`)."""
    return quantize_scaled(x, scaling_named("rowwise"), fp8_dtype, columnwise, dtype)


def requantize(t: Float8Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> Float8Tensor:
    """``t`` in ``fp8_dtype`` with (or without) the transposed copy; no work when it matches."""
    if t.fp8_dtype == fp8_dtype and (t._transpose is not None) == columnwise:
        return t
    if t.fp8_dtype == fp8_dtype and not columnwise:
        return Float8Tensor(t._data, t._scale_inv, t.dtype)
    if not t.per_tensor:
        return quantize_scaled(t._dequantize_raw(), scaling_of(t._data, t._scale_inv),
                               fp8_dtype, columnwise, t.dtype)
    return quantize_raw(t._dequantize_raw(), fp8_dtype, columnwise, t.dtype)


def per_column_scales(scale_inv: torch.Tensor, shape) -> torch.Tensor:
    """Per-column scales (``(1, ..., cols)``) for data viewed as ``shape``."""
    return scale_inv.reshape(*([1] * (len(shape) - 1)), shape[-1])
