"""fusible.quantize: a differentiable cast of an ordinary tensor to a Float8Tensor (the way
back, ``Float8Tensor.dequantize``, lives with the tensor)."""

from __future__ import annotations

import torch

from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.tensor.quantize import quantize_raw


class Quantize(torch.autograd.Function):
    """tensor -> Float8Tensor; the gradient (FP8 or not) goes back in the tensor's dtype."""

    @staticmethod
    def forward(ctx, x, fp8_dtype, columnwise):
        return quantize_raw(x, fp8_dtype, columnwise)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, Float8Tensor):
            grad = grad._dequantize_raw()
        return grad, None, None


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *,
             columnwise: bool = False) -> Float8Tensor:
    """Quantize ``x`` to FP8 with per-tensor current scaling.

    Parameters
    ----------
    x : Tensor
        A floating-point tensor.
    fp8_dtype : torch.dtype
        ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
    columnwise : bool
        Also make the transposed copy that a GEMM on the other side needs.

    Returns
    -------
    Float8Tensor
        Differentiable: its gradient reaches ``x`` in ``x``'s dtype.
    """
    if isinstance(x, Float8Tensor):
        raise TypeError("fusible.quantize: the input is a Float8Tensor already")
    if not x.is_floating_point():
        raise TypeError(f"fusible.quantize needs a floating-point tensor, got {x.dtype}")
    return Quantize.apply(x, fp8_dtype, columnwise)
