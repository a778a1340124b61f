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
from fusible.quantization.float8_tensor import Float8Tensor, quantize_raw, quantize_scaled
from fusible.quantization.scaling import Scaling, registered_scalings, scaling_named


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
        What one scale covers: the name of a registered
        :class:`~fusible.quantization.scaling.Scaling` (``"tensorwise"``, ``"rowwise"``,
        ``"blockwise_1x128"``, ``"blockwise_128x128"``, ``"mx_1x32"``, or a plugin's).
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
        if value not in registered_scalings():
            raise ValueError(f"Float8Format: granularity must be a registered scaling "
                             f"({', '.join(registered_scalings())}), got {value!r}")

    @property
    def scaling(self) -> Scaling:
        """The registered scaling this format's granularity names."""
        return scaling_named(self.granularity)

    @property
    def per_tensor(self) -> bool:
        """Whether one scale covers the whole tensor."""
        return self.granularity == "tensorwise"

    def cast_args(self) -> tuple:
        """``(fp8_dtype, its largest value, columnwise)``: what the fused cast kernels take."""
        return self.fp8_dtype, FP8_MAX[self.fp8_dtype], self.columnwise

    def rowwise(self) -> "Float8Format":
        """The same format without the transposed copy."""
        return attrs.evolve(self, columnwise=False) if self.columnwise else self

    @property
    def kernel_cast(self) -> bool:
        """Whether the producers' fused casts (norms, activations: one scale per tensor)
        write this format; otherwise they hand over high precision and the cast follows
        them in their stage."""
        return self.scaling.kernel_cast

    def matches(self, t) -> bool:
        """Whether the Float8Tensor ``t`` is of this FP8 dtype and scaling (its
        transposed copy aside)."""
        return (isinstance(t, Float8Tensor) and t.fp8_dtype == self.fp8_dtype
                and self.scaling.describes(t._data if t._data.dim() == 2 or self.per_tensor
                                           else t._data.reshape(-1, t.shape[-1]),
                                           _scales_2d(t)))


def to_format(t, fmt: Optional[Float8Format]):
    """``t`` in format ``fmt`` (None: unchanged).

    A plain tensor is quantized with current scaling; a Float8Tensor of the format
    passes; one with another FP8 dtype is requantized; a missing transposed copy is
    made from the FP8 data (no requantization).
    """
    if fmt is None:
        return t
    if not fmt.per_tensor:
        if fmt.matches(t) and (t._transpose is not None or not fmt.columnwise):
            return t
        values = t._dequantize_raw() if isinstance(t, Float8Tensor) else t
        return quantize_scaled(values, fmt.scaling, fmt.fp8_dtype, fmt.columnwise, values.dtype)
    if not isinstance(t, Float8Tensor):
        return quantize_raw(t, fmt.fp8_dtype, fmt.columnwise)
    if not fmt.matches(t):
        return quantize_raw(t._dequantize_raw(), fmt.fp8_dtype, fmt.columnwise, t.dtype)
    if fmt.columnwise and t._transpose is None:
        return Float8Tensor(t._data, t._scale_inv, t.dtype, transposed_copy(t._data))
    return t


def _scales_2d(t: Float8Tensor):
    """``t``'s scales as for its data seen as (tokens, features): scales per row (or per
    tile of a row) with the data's leading dimensions flattened like them."""
    scale_inv = t._scale_inv
    if scale_inv.dim() > 2 and scale_inv.shape[:-1] == t._data.shape[:-1]:
        return scale_inv.reshape(-1, scale_inv.shape[-1])
    return scale_inv


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
