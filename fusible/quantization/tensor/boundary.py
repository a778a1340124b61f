"""Float8Tensors across custom-op boundaries: flattened to their inner tensors and rebuilt.

Arguments: a field annotated ``Fp8Able`` (or ``Optional[Fp8Able]``) becomes five
schema arguments, ``(data or tensor, scale_inv, transposed copy, its scale_inv,
original dtype)``. Results of a stage that runs under an FP8 recipe: each tensor becomes
four, ``(data or tensor, scale_inv, transposed copy, its scale_inv)``, with empty 1-D
placeholders where a part is missing; a ``scale_inv`` that is not 1-D (0-d per tensor,
``(..., rows, 1)`` per row) marks a Float8Tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible.core.schema import SchemaType, register_schema_type
from fusible.quantization.tensor.float8_tensor import Float8Tensor, Fp8Able


def _flatten_fp8able(value) -> list:
    if value is None:
        return [None, None, None, None, None]
    if isinstance(value, Float8Tensor):
        return [value._data, value._scale_inv, value._transpose, value._transpose_scale_inv,
                value.dtype]
    return [value, None, None, None, None]


def _unflatten_fp8able(values):
    data, scale_inv, transpose, transpose_scale_inv, dtype = values
    if scale_inv is None:
        return data
    return Float8Tensor(data, scale_inv, dtype, transpose,
                        transpose_scale_inv=transpose_scale_inv)


_FP8ABLE_SCHEMA = SchemaType(("Tensor?", "Tensor?", "Tensor?", "Tensor?", "ScalarType?"),
                             _flatten_fp8able, _unflatten_fp8able)
register_schema_type(Fp8Able, _FP8ABLE_SCHEMA)
register_schema_type(Optional[Fp8Able], _FP8ABLE_SCHEMA)


def encode_results(tensors: list, fp8: bool, like: torch.Tensor) -> list:
    """Flatten stage results for a ``Tensor[]`` return (None becomes an empty placeholder)."""
    def empty():
        return like.new_empty(0)

    if not fp8:
        return [t if t is not None else empty() for t in tensors]
    out = []
    for t in tensors:
        if isinstance(t, Float8Tensor):
            out += [t._data, t._scale_inv, _or(t._transpose, empty),
                    _or(t._transpose_scale_inv, empty)]
        else:
            out += [t if t is not None else empty(), empty(), empty(), empty()]
    return out


def _or(t, empty):
    return t if t is not None else empty()


def decode_results(flat: list, fp8: bool, dtype: torch.dtype) -> list:
    """Undo :func:`encode_results` (placeholders stay empty tensors)."""
    if not fp8:
        return list(flat)
    out = []
    for i in range(0, len(flat), 4):
        data, scale_inv, transpose, t_scale_inv = flat[i:i + 4]
        if scale_inv.dim() != 1:
            out.append(Float8Tensor(data, scale_inv, dtype,
                                    transpose if transpose.dim() == 2 else None,
                                    transpose_scale_inv=t_scale_inv
                                    if t_scale_inv.dim() == 2 else None))
        else:
            out.append(data)
    return out
