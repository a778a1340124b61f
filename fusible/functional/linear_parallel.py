"""A linear layer's tensor-parallel collectives around its GEMMs: the input or ``dy``
all-gathered (in FP8 under a recipe), a row-parallel output summed over the group, a
column-parallel dgrad summed while the wgrad GEMM runs."""

from __future__ import annotations

from typing import Optional

import torch

from fusible.functional import parallel
from fusible.functional.parallel import TensorParallel
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.format import Float8Format

Tensor = torch.Tensor


def gather_fp8(x: Tensor, tp: TensorParallel, fmt: Float8Format) -> Float8Tensor:
    """All-gather ``x`` along dim 0 in FP8 (``fmt``), as a 2-D Float8Tensor (tokens,
    features).

    Each rank casts its own tokens and the FP8 bytes are gathered (half of bf16's) with
    their scales, the bits of gathering in high precision and then quantizing: one scale
    per tensor is the group's (the absolute maxima all-reduced first); scales per token
    (or per tile of a token) are each rank's own; the transposed copy's scales per
    feature span the group's tokens, their maxima all-reduced first
    (:meth:`~fusible.quantization.scalings.base.Scaling.cast_gathered`). An FP8 ``x`` with its
    own scale is dequantized first.
    """
    if isinstance(x, Float8Tensor):
        x = x._dequantize_raw()
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (tokens, features)
    parts = fmt.scaling.cast_gathered(x2, fmt.fp8_dtype, fmt.columnwise,
                                      lambda t: parallel.all_gather(t, tp),
                                      lambda t: parallel.all_reduce(t, tp, "max"),
                                      state=fmt.state)
    data, scale_inv, transpose, t_scale_inv = parts
    return Float8Tensor(data, scale_inv, x.dtype, transpose, transpose_scale_inv=t_scale_inv)


def gathered_lead(x: Tensor, tp: TensorParallel) -> tuple:
    """The leading dimensions of ``x`` gathered along dim 0."""
    return (x.shape[0] * tp.world_size, *x.shape[1:-1])


def reduce_output(y: Tensor, tp: TensorParallel) -> Tensor:
    """A row-parallel output summed over the group; others unchanged."""
    if not (tp.active and tp.mode == "row"):
        return y
    return parallel.sum_over_group(y, tp)


def reduces_dgrad(tp: TensorParallel) -> bool:
    """Whether the dgrad is a partial sum, summed over the group (column parallel)."""
    return tp.active and tp.mode == "column"


def start_dgrad_reduction(dx: Optional[Tensor], tp: TensorParallel) -> Optional[Tensor]:
    """Start summing a column-parallel dgrad (a partial sum) over the group; the caller
    issues the wgrad GEMM, which overlaps with it, then :func:`finish_dgrad_reduction`."""
    if dx is None or not reduces_dgrad(tp):
        return dx
    return parallel.sum_over_group(dx, tp, wait=False)


def finish_dgrad_reduction(dx: Optional[Tensor], tp: TensorParallel) -> Optional[Tensor]:
    """The dgrad, once its reduction (if one was started) is done: no wait op otherwise
    (an op call of host time in every backward)."""
    return parallel.wait(dx) if dx is not None and reduces_dgrad(tp) else dx
