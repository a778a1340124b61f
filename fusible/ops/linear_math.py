"""The GEMMs of a linear layer, in high precision or FP8, shared by BasicLinear and fusions.

FP8 GEMMs use ``torch._scaled_mm`` with the layouts Hopper needs: the first
operand row-major, the second column-major. The forward reads ``x`` and
``weight.T`` (a view of the row-major weight); dgrad reads ``dy`` and the
weight's transposed copy; wgrad reads the transposed copies of ``dy`` and ``x``.
Each tensor is quantized once, with the copies the backward will need.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible import distributed
from fusible.distributed import NOT_PARALLEL, TensorParallel
from fusible.kernels.fp8_cast import transposed_copy
from fusible.quantization.float8_tensor import Float8Tensor, quantize_raw
from fusible.quantization.flow import to_fp8_format

Tensor = torch.Tensor


def tokens_2d(t: Tensor) -> Tensor:
    """View a (..., features) tensor as (tokens, features) for a GEMM."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def like_tokens(y2: Tensor, t: Tensor) -> Tensor:
    """View a (tokens, features) GEMM result with the leading dimensions of ``t``."""
    return y2 if t.dim() == 2 else y2.view(*t.shape[:-1], y2.shape[-1])


def linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T (+ bias)``; with a bias, one GEMM with the bias epilogue."""
    x2 = tokens_2d(x)
    y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
    return like_tokens(y, x)


def linear_dgrad(grad_output: Tensor, weight: Tensor,
                 accumulate_into: Optional[Tensor] = None) -> Tensor:
    """``dy @ weight``; with ``accumulate_into``, ``that + dy @ weight`` in one GEMM."""
    dy2 = tokens_2d(grad_output)
    if accumulate_into is None:
        dx = torch.mm(dy2, weight)
    else:
        dx = torch.addmm(tokens_2d(accumulate_into), dy2, weight)
    return like_tokens(dx, grad_output)


def linear_wgrad(grad_output: Tensor, x: Tensor) -> Tensor:
    """``dy.T @ x`` summed over all tokens."""
    return torch.mm(tokens_2d(grad_output).t(), tokens_2d(x))


def handed_in_fp8(x, fp8_dtype: Optional[torch.dtype]) -> bool:
    """Whether the GEMM input ``x`` arrived already quantized to ``fp8_dtype``.

    The stage then shares the caller's FP8 buffers; it must not return them (a custom
    op's outputs may not alias its inputs), so the caller saves ``x`` itself.
    """
    return isinstance(x, Float8Tensor) and x.fp8_dtype == fp8_dtype


def transposed_only(transpose: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Float8Tensor:
    """A Float8Tensor holding only the transposed copy (its data is a view of it): what
    the backward GEMMs read of a saved input or weight, at half the memory."""
    return Float8Tensor(transpose.t(), scale_inv, dtype, transpose)


def as_fp8(t: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> Float8Tensor:
    """``t`` as a 2-D Float8Tensor of ``fp8_dtype`` (with the transposed copy if asked);
    a Float8Tensor handed over by the previous stage is used as it is."""
    return to_fp8_format(tokens_2d(t), (fp8_dtype, columnwise))


def fp8_gemm(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
             bias: Optional[Tensor], out_dtype: torch.dtype, fast_accum: bool = False) -> Tensor:
    """``(a * sa) @ (b * sb) (+ bias)``: ``a`` row-major FP8, ``b`` column-major FP8.

    ``fast_accum`` lets Hopper accumulate in its faster, less precise FP8 mode; like
    TransformerEngine and torchao we take it for the forward GEMM only (gradients sum
    over many more products).
    """
    epilogue = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
    y = torch._scaled_mm(a, b, scale_a=a_scale_inv, scale_b=b_scale_inv,
                         bias=bias if epilogue else None, out_dtype=out_dtype,
                         use_fast_accum=fast_accum)
    if bias is not None and not epilogue:  # no bias epilogue for float32 outputs
        y = y + bias
    return y


def gemm_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                 fp8_dtype: Optional[torch.dtype], keep_input_t: bool,
                 tp: TensorParallel = NOT_PARALLEL):
    """``(y, the input as saved)``: in high precision the gathered input (column +
    sequence parallel) or None, under ``fp8_dtype`` the FP8 input.

    Tensor parallelism: column + sequence parallel all-gathers ``x`` first; row sums
    the output over the group (all-reduce, or reduce-scatter with sequence parallel),
    so a row-parallel ``bias`` would be added on every rank: callers refuse it.
    """
    if tp.active and tp.mode == "row" and bias is not None:
        raise ValueError(f"a row-parallel GEMM cannot add a bias before its reduction ({tp})")
    if fp8_dtype is None:
        x = distributed.all_gather(x, tp) if tp.gathers_input else x
        return (_reduce_output(linear_forward(x, weight, bias), tp),
                x if tp.gathers_input else None)
    if tp.gathers_input:
        x_q, lead = gather_fp8(x, tp, fp8_dtype, keep_input_t), _gathered_lead(x, tp)
    else:
        x_q, lead = as_fp8(x, fp8_dtype, keep_input_t and not handed_in_fp8(x, fp8_dtype)), \
            x.shape[:-1]
    w_q = quantize_raw(weight, fp8_dtype)
    y = fp8_gemm(x_q._data, x_q._scale_inv, w_q._data.t(), w_q._scale_inv, bias, weight.dtype,
                 fast_accum=True)
    return _reduce_output(y.view(*lead, y.shape[-1]), tp), x_q


def gather_fp8(x: Tensor, tp: TensorParallel, fp8_dtype: torch.dtype,
               columnwise: bool) -> Float8Tensor:
    """All-gather ``x`` along dim 0 in FP8, as a 2-D Float8Tensor (tokens, features).

    One scale for the whole group: the absolute maxima are all-reduced first, each rank
    casts its own part with it, and the FP8 bytes are gathered (half of bf16's). The
    same bits as gathering in high precision and then quantizing. An FP8 ``x`` with its
    own scale is dequantized first. The transposed copy (for wgrad) is made from the
    gathered data.
    """
    if isinstance(x, Float8Tensor):
        x = x._dequantize_raw()
    x2 = tokens_2d(x)
    # One reduction kernel, no |x| temporary; NaN propagates as in the cast's own amax.
    local_amax = torch.linalg.vector_norm(x2, float("inf"), dtype=torch.float32)
    amax = distributed.all_reduce(local_amax, tp, "max")
    local = quantize_raw(x2, fp8_dtype, False, amax=amax)
    data = distributed.all_gather(local._data, tp)
    return Float8Tensor(data, local._scale_inv, x.dtype,
                        transposed_copy(data) if columnwise else None)


def _gathered_lead(x: Tensor, tp: TensorParallel) -> tuple:
    """The leading dimensions of ``x`` gathered along dim 0."""
    return (x.shape[0] * tp.world_size, *x.shape[1:-1])


def _reduce_output(y: Tensor, tp: TensorParallel) -> Tensor:
    """A row-parallel output summed over the group; others unchanged."""
    if not (tp.active and tp.mode == "row"):
        return y
    return distributed.sum_over_group(y, tp)


def _start_dgrad_reduction(dx: Optional[Tensor], tp: TensorParallel) -> Optional[Tensor]:
    """Start summing a column-parallel dgrad (a partial sum) over the group; the caller
    issues the wgrad GEMM, which overlaps with it, then :func:`_finish`."""
    if dx is None or not (tp.active and tp.mode == "column"):
        return dx
    return distributed.sum_over_group(dx, tp, wait=False)


def _finish(dx: Optional[Tensor]) -> Optional[Tensor]:
    return None if dx is None else distributed.wait(dx)


def gemm_backward(dy: Tensor, x_saved, w_saved, grad_fp8_dtype: Optional[torch.dtype],
                  need_dgrad: bool, need_wgrad: bool, accumulate_into: Optional[Tensor] = None,
                  tp: TensorParallel = NOT_PARALLEL):
    """``(dgrad or None, wgrad or None)`` from the saved input and weight (under FP8,
    Float8Tensors with their transposed copies).

    ``accumulate_into`` is added to the dgrad (in the GEMM in high precision); not with
    a column-parallel ``tp``, whose dgrad is summed over the group afterwards. Row +
    sequence parallel all-gathers ``dy`` first.
    """
    if tp.active and tp.mode == "column" and accumulate_into is not None:
        raise ValueError(f"a column-parallel dgrad is summed over the group: it cannot "
                         f"accumulate into a local tensor ({tp})")
    if grad_fp8_dtype is None:
        dy = distributed.all_gather(dy, tp) if tp.gathers_grad else dy
        dx = linear_dgrad(dy, w_saved, accumulate_into) if need_dgrad else None
        dx = _start_dgrad_reduction(dx, tp)
        dw = linear_wgrad(dy, x_saved) if need_wgrad else None
        return _finish(dx), dw
    if tp.gathers_grad:
        dy_q, lead = gather_fp8(dy, tp, grad_fp8_dtype, need_wgrad), _gathered_lead(dy, tp)
    else:
        dy_q, lead = as_fp8(dy, grad_fp8_dtype, need_wgrad), dy.shape[:-1]
    dx = dw = None
    if need_dgrad:
        dx = fp8_gemm(dy_q._data, dy_q._scale_inv, w_saved._transpose.t(), w_saved._scale_inv,
                      None, w_saved.dtype)
        dx = dx.view(*lead, dx.shape[-1])
        if accumulate_into is not None:
            dx = dx + accumulate_into
    dx = _start_dgrad_reduction(dx, tp)
    if need_wgrad:
        dw = fp8_gemm(dy_q._transpose, dy_q._scale_inv, x_saved._transpose.t(),
                      x_saved._scale_inv, None, x_saved.dtype)
    return _finish(dx), dw
