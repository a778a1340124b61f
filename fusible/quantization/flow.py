"""Handing FP8 from one stage to the next."""

from __future__ import annotations

from fusible.kernels.fp8_cast import transposed_copy
from fusible.quantization.float8_tensor import Float8Tensor, quantize_raw


def to_fp8_format(t, fmt):
    """``t`` in the ``(fp8_dtype, transposed copy)`` format ``fmt`` (None: unchanged).

    A plain tensor is quantized with current scaling; a Float8Tensor of the format
    passes; one with another FP8 dtype is requantized; a missing transposed copy
    is made from the FP8 data (no requantization).
    """
    if fmt is None:
        return t
    fp8_dtype, columnwise = fmt
    if not isinstance(t, Float8Tensor):
        return quantize_raw(t, fp8_dtype, columnwise)
    if t.fp8_dtype != fp8_dtype:
        return quantize_raw(t._dequantize_raw(), fp8_dtype, columnwise, t.dtype)
    if columnwise and t._transpose is None:
        return Float8Tensor(t._data, t._scale_inv, t.dtype, transposed_copy(t._data))
    return t
