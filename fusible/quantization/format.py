"""Float8Format: how one tensor is quantized, as a value that stages ask for and hand on.

A consuming stage says in which format it wants its input or gradient
(``input_format(recipe, needs)`` / ``grad_format(...)``); the stage before it
produces that format. The format crosses custom ops as an ordinary argument.
"""

from __future__ import annotations

import functools
from typing import Optional

import attrs
import torch

from fusible.core.schema import SchemaType, register_schema_type
from fusible.kernels.fp8_cast import transposed_copy
from fusible.quantization.cast import FP8_MAX
from fusible.quantization.float8_tensor import Float8Tensor, quantize_raw

GRANULARITIES = ("tensorwise",)


@attrs.frozen
class Float8Format:
    """A quantized tensor's format.

    Attributes
    ----------
    fp8_dtype : torch.dtype
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    columnwise : bool
        Also keep the transposed (features, tokens) copy that a GEMM on the other
        operand side needs (wgrad reads the input's and the gradient's).
    granularity : str
        What one scale covers: ``"tensorwise"`` (per-tensor current scaling).
    """

    fp8_dtype: torch.dtype = attrs.field()
    columnwise: bool = False
    granularity: str = attrs.field(default="tensorwise")

    @fp8_dtype.validator
    def _check_dtype(self, attribute, value):
        if value not in FP8_MAX:
            raise ValueError(f"Float8Format: fp8_dtype must be one of {list(FP8_MAX)}, "
                             f"got {value!r}")

    @granularity.validator
    def _check_granularity(self, attribute, value):
        if value not in GRANULARITIES:
            raise ValueError(f"Float8Format: granularity must be one of {GRANULARITIES}, "
                             f"got {value!r}")

    def cast_args(self) -> tuple:
        """``(fp8_dtype, its largest value, columnwise)``: what the fused cast kernels take."""
        return self.fp8_dtype, FP8_MAX[self.fp8_dtype], self.columnwise

    def rowwise(self) -> "Float8Format":
        """The same format without the transposed copy."""
        return attrs.evolve(self, columnwise=False) if self.columnwise else self


def to_format(t, fmt: Optional[Float8Format]):
    """``t`` in format ``fmt`` (None: unchanged).

    A plain tensor is quantized with current scaling; a Float8Tensor of the format
    passes; one with another FP8 dtype is requantized; a missing transposed copy is
    made from the FP8 data (no requantization).
    """
    if fmt is None:
        return t
    if not isinstance(t, Float8Tensor):
        return quantize_raw(t, fmt.fp8_dtype, fmt.columnwise)
    if t.fp8_dtype != fmt.fp8_dtype:
        return quantize_raw(t._dequantize_raw(), fmt.fp8_dtype, fmt.columnwise, t.dtype)
    if fmt.columnwise and t._transpose is None:
        return Float8Tensor(t._data, t._scale_inv, t.dtype, transposed_copy(t._data))
    return t


def _flatten(fmt: Optional[Float8Format]) -> list:
    if fmt is None:
        return [None, False, ""]
    return [fmt.fp8_dtype, fmt.columnwise, fmt.granularity]


def _unflatten(values) -> Optional[Float8Format]:
    fp8_dtype, columnwise, granularity = values
    return None if fp8_dtype is None else _format(fp8_dtype, columnwise, granularity)


@functools.lru_cache(maxsize=None)
def _format(fp8_dtype, columnwise: bool, granularity: str) -> Float8Format:
    """One Float8Format per value: rebuilt inside every custom-op call, so cached."""
    return Float8Format(fp8_dtype, columnwise, granularity)


_FORMAT_SCHEMA = SchemaType(("ScalarType?", "bool", "str"), _flatten, _unflatten)
register_schema_type(Float8Format, _FORMAT_SCHEMA)
register_schema_type(Optional[Float8Format], _FORMAT_SCHEMA)
