"""Normalisation arithmetic (LayerNorm, RMSNorm) and the shape rules the norm ops share."""

from __future__ import annotations

from typing import Optional

import torch

from fusible.core import checks
from fusible.kernels import norms as norm_kernels
from fusible.kernels import triton_can_run
from fusible.quantization.casts.common import FP8_MAX
from fusible.quantization.casts.tensorwise import cast_tensorwise, tensor_amax
from fusible.quantization.format import Float8Format, to_format
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.tensor.quantize import from_cast_parts, quantize_raw, transposed_only

# What fusion authors import (docs/writing_a_fusion.md, "Helpers for fusion authors"); the
# rest serves the norm ops.
__all__ = ["effective_gamma", "layer_norm_backward", "norm_forward",
           "norm_forward_fp8_keeping_amax", "norm_output_fp8_again", "rms_norm_backward"]

Tensor = torch.Tensor


# The arguments the norm ops share, checked on every assignment (sequence_parallel: in the
# constructor, a view of the op's parallel record afterwards).
NORM_CHECKS = {"normalized_shape": checks.int_tuple("normalized_shape"),
               "eps": checks.real("eps", minimum=0.0),
               "sequence_parallel": checks.boolean("sequence_parallel"),
               "recompute_output": checks.boolean("recompute_output")}


def norm_options(op) -> str:
    """The options a norm's description names when they are on."""
    names = ("sequence_parallel", "zero_centered_gamma", "recompute_output")
    return "".join(f", {name}=True" for name in names if getattr(op, name, False))


def check_trailing(op, shape, normalized_shape) -> None:
    """ValueError naming ``op`` unless ``shape`` ends with ``normalized_shape``."""
    n = len(normalized_shape)
    if len(shape) < n or tuple(shape[-n:]) != normalized_shape:
        raise ValueError(f"{op.describe()} got input of shape {tuple(shape)}; its trailing "
                         f"dimensions must be {normalized_shape}")


def _cpu_float_copies(*tensors):
    """float32 copies of 16-bit CPU tensors: PyTorch's CPU kernel keeps mean and rstd in
    the input dtype, too coarse for the backward. CUDA accumulates in float32 already.
    Also wherever the weight is float32 beside a 16-bit input (a zero-centred gamma's
    ``1 + gamma``): PyTorch's kernels take one dtype for weight and bias."""
    x = tensors[0]
    if x.dtype in (torch.bfloat16, torch.float16) and (
            x.device.type == "cpu" or any(t is not None and t.dtype != x.dtype
                                          for t in tensors)):
        return tuple(None if t is None else t.float() for t in tensors)
    return tensors


def effective_gamma(weight: Tensor, zero_centered: bool) -> Tensor:
    """What a norm multiplies by.

    Parameters
    ----------
    weight : Tensor
        The norm's weight.
    zero_centered : bool
        The norm's ``zero_centered_gamma`` (TransformerEngine's).

    Returns
    -------
    Tensor
        ``weight``, or for a zero-centred gamma ``1 + weight`` computed in float32
        (float64 for a float64 weight), as TransformerEngine's kernels compute it.
    """
    if not zero_centered:
        return weight
    return weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32) + 1


def _norm_fp8(x, weight, bias, eps, center, output_format) -> tuple:
    """``(Float8Tensor y, mean, rstd)`` from the Triton kernels that write ``y`` in FP8."""
    parts, mean, rstd = norm_kernels.norm_forward_fp8_triton(
        x, weight, bias, eps, center, *output_format.cast_args())
    return from_cast_parts(parts, x.dtype), mean, rstd


def layer_norm_forward(x: Tensor, weight: Tensor, bias: Tensor, normalized_shape: list,
                       eps: float, output_format: Optional[Float8Format] = None) -> tuple:
    """``(y, mean, rstd)``, ``y`` in ``x``'s dtype (the statistics float32 for 16-bit
    inputs).

    On CUDA one Triton kernel; with ``output_format`` ``y`` comes as that Float8Tensor,
    never written in high precision. Elsewhere PyTorch's kernel, and a high-precision
    ``y`` (the caller quantizes it).
    """
    if triton_can_run(x, weight, bias):
        if output_format is not None and x.numel():
            return _norm_fp8(x, weight, bias, eps, True, output_format)
        return norm_kernels.norm_forward_triton(x, weight, bias, eps, True)
    xc, w, b = _cpu_float_copies(x, weight, bias)
    y, mean, rstd = torch.native_layer_norm(xc, normalized_shape, w, b, eps)
    return y.to(x.dtype), mean, rstd


def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor,
                        bias: Tensor, normalized_shape: list, mask: list) -> tuple:
    """LayerNorm's backward (one Triton kernel on CUDA).

    Parameters
    ----------
    dy, x : Tensor
        The output's gradient and the norm's input.
    mean, rstd : Tensor
        The forward's statistics.
    weight, bias : Tensor
        The norm's (the effective gamma: :func:`effective_gamma`).
    normalized_shape : list of int
        The trailing dimensions normalised over.
    mask : list of bool
        Which of ``(dx, dweight, dbias)`` are needed.

    Returns
    -------
    tuple
        ``(dx, dweight, dbias)``, each None where ``mask`` says it is not needed.
    """
    if triton_can_run(dy, x, weight):
        return norm_kernels.norm_backward_triton(dy, x, mean, rstd, weight, True, *mask)
    dyc, xc, w, b = _cpu_float_copies(dy, x, weight, bias)
    grads = torch.ops.aten.native_layer_norm_backward(dyc, xc, normalized_shape, mean, rstd,
                                                      w, b, mask)
    return tuple(None if g is None else g.to(dy.dtype) for g in grads)


def _float(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def rms_norm_forward(x: Tensor, weight: Tensor, normalized_shape: list, eps: float,
                     output_format: Optional[Float8Format] = None) -> tuple:
    """``(y, rstd)``: ``x * rsqrt(mean(x**2) + eps) * weight`` in float32 for 16-bit
    inputs, ``y`` in ``x``'s dtype.

    On CUDA one Triton kernel; with ``output_format`` ``y`` comes as that Float8Tensor,
    never written in high precision. Elsewhere the PyTorch ops, and a high-precision
    ``y`` (the caller quantizes it).
    """
    if triton_can_run(x, weight):
        if output_format is not None and x.numel():
            y, _, rstd = _norm_fp8(x, weight, None, eps, False, output_format)
            return y, rstd
        y, _, rstd = norm_kernels.norm_forward_triton(x, weight, None, eps, False)
        return y, rstd
    xf = _float(x)
    dims = tuple(range(-len(normalized_shape), 0))
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    return (xf * rstd * _float(weight)).to(x.dtype), rstd


def rms_norm_backward(dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor,
                      normalized_shape: list, need_dx: bool, need_dw: bool,
                      accumulate_into: Optional[Tensor] = None
                      ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """RMSNorm's backward (one Triton kernel on CUDA).

    Parameters
    ----------
    dy, x : Tensor
        The output's gradient and the norm's input.
    rstd : Tensor
        The forward's statistic.
    weight : Tensor
        The norm's (the effective gamma: :func:`effective_gamma`).
    normalized_shape : list of int
        The trailing dimensions normalised over.
    need_dx, need_dw : bool
        Which gradients to compute.
    accumulate_into : Tensor, optional
        Added to ``dx`` before its one rounding (a residual branch's gradient).

    Returns
    -------
    tuple
        ``(dx, dweight)``, each None where not needed.
    """
    if triton_can_run(dy, x, weight):
        dx, dw, _ = norm_kernels.norm_backward_triton(dy, x, None, rstd, weight, False, need_dx,
                                                      need_dw, accumulate_into=accumulate_into)
        return dx, dw
    dtype = dy.dtype
    dims = tuple(range(-len(normalized_shape), 0))
    dyf, x_hat = _float(dy), _float(x) * rstd
    dx = dw = None
    if need_dx:
        g = dyf * _float(weight)
        dx = rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))
        if accumulate_into is not None:
            dx = dx + _float(accumulate_into)
        dx = dx.to(dtype)
    if need_dw:
        dw = (dyf * x_hat).reshape(-1, *normalized_shape).sum(0).to(dtype)
    return dx, dw


def norm_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], normalized_shape: list,
                 eps: float, center: bool) -> tuple:
    """A norm's forward in high precision, with the kernels of the norm ops.

    Parameters
    ----------
    x : Tensor
        The input.
    weight : Tensor
        The effective gamma (:func:`effective_gamma`).
    bias : Tensor or None
        LayerNorm's bias (with ``center``).
    normalized_shape : list of int
        The trailing dimensions normalised over.
    eps : float
    center : bool
        LayerNorm (the mean subtracted, ``bias`` added); RMSNorm without.

    Returns
    -------
    tuple
        ``(y, mean or None, rstd)``.
    """
    if center:
        assert bias is not None  # LayerNorm's
        return layer_norm_forward(x, weight, bias, normalized_shape, eps)
    y, rstd = rms_norm_forward(x, weight, normalized_shape, eps)
    return y, None, rstd


def norm_forward_fp8_keeping_amax(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                                  normalized_shape: list, eps: float, center: bool,
                                  fmt: Float8Format) -> tuple:
    """A norm's forward with ``y`` in FP8, the same bits as the norm op's FP8 forward (or
    its output quantized after it), keeping what casting ``y`` again takes.

    Parameters
    ----------
    x, weight, bias, normalized_shape, eps, center
        As for :func:`norm_forward`.
    fmt : Float8Format
        The format of ``y`` (bound to its op's state where stateful).

    Returns
    -------
    tuple
        ``(Float8Tensor y, mean, rstd, amax)``: ``amax``, ``y``'s absolute maximum in a
        tensor of its own (a stateful format's: the amax its state scales this cast by),
        is what :func:`norm_output_fp8_again` takes.
    """
    if fmt.stateful:
        assert fmt.state is not None  # a stateful format is bound to its op's state
        amax = fmt.state[0].clone()
        if center:
            assert bias is not None  # LayerNorm's
            y, mean, rstd = layer_norm_forward(x, weight, bias, normalized_shape, eps, fmt)
        else:
            (y, rstd), mean = rms_norm_forward(x, weight, normalized_shape, eps, fmt), None
        return to_format(y, fmt), mean, rstd, amax
    kernels = (x, weight) if bias is None else (x, weight, bias)
    if triton_can_run(*kernels) and x.numel():
        amax = torch.zeros((), device=x.device, dtype=torch.float32)
        parts, mean, rstd = norm_kernels.norm_forward_fp8_triton(
            x, weight, bias, eps, center, fmt.fp8_dtype, FP8_MAX[fmt.fp8_dtype],
            fmt.columnwise, amax=amax)  # not stateful here: cast_args()'s three
        return from_cast_parts(parts, x.dtype), mean, rstd, amax
    y, mean, rstd = norm_forward(x, weight, bias, normalized_shape, eps, center)
    amax = tensor_amax(y)
    return quantize_raw(y, fmt.fp8_dtype, fmt.columnwise, amax=amax), mean, rstd, amax


def norm_output_fp8_again(x: Tensor, weight: Tensor, bias: Optional[Tensor], mean, rstd,
                          amax: Tensor, normalized_shape: list, eps: float, center: bool,
                          fmt: Float8Format) -> Float8Tensor:
    """The ``y`` of :func:`norm_forward_fp8_keeping_amax` once more, bit for bit (the same
    statistics, the same scale): a norm's output recomputed for a weight gradient.

    Parameters
    ----------
    x, weight, bias
        As for :func:`norm_forward`.
    mean, rstd : Tensor
        The forward's statistics (``mean`` None for RMSNorm).
    amax : Tensor
        The forward's, from :func:`norm_forward_fp8_keeping_amax`.
    normalized_shape, eps, center
        As for :func:`norm_forward`.
    fmt : Float8Format
        The forward's format of ``y``.

    Returns
    -------
    Float8Tensor
        ``y``'s transposed copy only: what a weight gradient reads.
    """
    kernels = (x, weight) if bias is None else (x, weight, bias)
    if triton_can_run(*kernels) and x.numel():
        transpose, scale_inv = norm_kernels.norm_cast_fp8_triton(
            x, weight, bias, mean, rstd, amax, center, fmt.fp8_dtype, FP8_MAX[fmt.fp8_dtype],
            True, rowwise=False)
        return transposed_only(transpose, scale_inv, x.dtype)
    y = norm_forward(x, weight, bias, normalized_shape, eps, center)[0]
    transpose, scale_inv = cast_tensorwise(y, fmt.fp8_dtype, True, amax, rowwise=False)
    return transposed_only(transpose, scale_inv, x.dtype)
