"""FP8 grouped GEMMs (GroupedLinear under an FP8 recipe).

Scaling: the tokens (the input, the output gradient) per tensor, as the recipe's
tensorwise formats, so a producer hands them over quantized like to a linear layer;
each group's weight by its own scale (experts' weights differ, and one group's scale
is what the grouped GEMM's per-group scale vector holds). Everything is E4M3: Hopper's
grouped FP8 GEMM (``torch._scaled_grouped_mm``) takes no E5M2 operand, so a grouped
layer's gradient is E4M3 under every recipe, on every device.

On Hopper GPUs with bf16 outputs, ``torch._scaled_grouped_mm``; on other GPUs Triton's
(``fusible.kernels.grouped_gemm`` with scales), both reading the sizes on the device; on
the CPU one ``torch._scaled_mm`` per group (the sizes read on the host); the same operands
and scales everywhere. :data:`HOPPER_KERNEL` picks the Hopper kernel ("torch", or
"triton" to compare them). The weight gradient contracts over each group's tokens: both
need every group's token count to be a multiple of 16 (16-byte aligned FP8 slices):
:func:`check_aligned_splits`, and ``fusible.moe.permute_tokens(..., align=16)`` pads
the groups to it.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible.functional.grouped import _ranges
from fusible.functional.linear import fp8_gemm
from fusible.kernels import fp8_cast, grouped_gemm
from fusible.quantization.casts.common import FP8_MAX
from fusible.quantization.casts.tensorwise import cast_tensorwise_torch

Tensor = torch.Tensor

# What one group's tokens must be a multiple of for the FP8 weight gradient.
FP8_TOKEN_ALIGNMENT = 16
# The grouped FP8 GEMM kernel on Hopper: "torch" (torch._scaled_grouped_mm) or "triton".
HOPPER_KERNEL = "torch"


def grouped_fp8_available(t: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs for operands on ``t``'s device with this
    output dtype: a Hopper GPU (compute capability 9.x), bf16 outputs only."""
    return (t.is_cuda and hasattr(torch, "_scaled_grouped_mm") and out_dtype == torch.bfloat16
            and torch.cuda.get_device_capability(t.device)[0] == 9)


def fp8_backend(t: Tensor, out_dtype: torch.dtype) -> str:
    """Which grouped FP8 GEMM runs for operands like ``t``: "torch", "triton" or "loop".

    Raises RuntimeError on a GPU without FP8 (compute capability below 8.9)."""
    if t.is_cuda and torch.cuda.get_device_capability(t.device) < (8, 9):
        raise RuntimeError(f"FP8 grouped GEMMs need a GPU of compute capability 8.9 or more "
                           f"(Ada, Hopper, Blackwell); {torch.cuda.get_device_name(t.device)} "
                           f"has {torch.cuda.get_device_capability(t.device)}")
    if grouped_fp8_available(t, out_dtype) and HOPPER_KERNEL == "torch":
        return "torch"
    if t.is_cuda and fp8_cast.triton is not None and type(t) in (torch.Tensor,
                                                                 torch.nn.Parameter):
        return "triton"
    return "loop"


def check_aligned_splits(splits: Tensor, where: str) -> None:
    """Asynchronously (on the device) that every group's token count is a multiple of
    16, as the FP8 weight gradient needs."""
    torch._assert_async((splits % FP8_TOKEN_ALIGNMENT == 0).all(),
                        f"{where} under FP8 needs each group's token count to be a multiple of "
                        f"{FP8_TOKEN_ALIGNMENT} for its weight gradient: route with "
                        f"fusible.moe.permute_tokens(..., align={FP8_TOKEN_ALIGNMENT})")


def grouped_weight_amax(weight: Tensor) -> Tensor:
    """Each group's absolute maximum, float32 (groups,): one reduction kernel, no |w|
    temporary; NaN where a group has one."""
    return torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), float("inf"), dim=1,
                                    dtype=torch.float32)


def cast_grouped_weight(weight: Tensor, fp8_dtype: torch.dtype, amax: Optional[Tensor] = None,
                        *, rowwise: bool = True, columnwise: bool = False) -> tuple:
    """``(data, transpose, scale_inv)``: each group ``g`` of ``weight`` (groups, rows,
    cols) scaled by ``FP8_MAX / amax[g]`` and saturated to FP8
    (:func:`~fusible.quantization.casts.common.scale_from_amax`'s rules), as (groups,
    rows, cols) where ``rowwise`` (what the forward reads) and as (groups, cols, rows)
    row-major where ``columnwise`` (what dgrad reads), None where not asked for.
    ``amax``: given, no reduction. On CUDA one Triton kernel writes both layouts from one
    read; elsewhere PyTorch ops, the same arithmetic."""
    if amax is None:
        amax = grouped_weight_amax(weight)
    if weight.is_cuda and fp8_cast.triton is not None:
        return fp8_cast.cast_batched_triton(weight, amax, fp8_dtype, FP8_MAX[fp8_dtype],
                                            rowwise, columnwise)
    data, scale_inv = cast_tensorwise_torch(weight, fp8_dtype, False, amax[:, None, None])
    transpose = data.transpose(-2, -1).contiguous() if columnwise else None
    return data if rowwise else None, transpose, scale_inv.reshape(-1)


def fp8_grouped_mm(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                   splits: Tensor, out_dtype: torch.dtype, fast_accum: bool) -> Tensor:
    """``out[group g's rows] = (a[those rows] * sa) @ (b[g] * sb[g]).T``: ``a`` (tokens,
    k) row-major FP8 with one scale, ``b`` (groups, n, k) row-major FP8 with one scale
    per group. The forward (``b`` the weight) and dgrad (``b`` its transposed copy)."""
    tokens, groups, n = a.shape[0], b.shape[0], b.shape[1]
    backend = fp8_backend(a, out_dtype)
    if backend == "triton":
        return grouped_gemm.grouped_mm_triton(a, b, splits, 128, 128, 64,
                                              scales=(a_scale_inv, b_scale_inv),
                                              out_dtype=out_dtype, num_warps=8)
    if backend == "torch":
        return torch._scaled_grouped_mm(
            a, b.transpose(-2, -1), a_scale_inv.expand(tokens).contiguous(),
            b_scale_inv[:, None].expand(groups, n).contiguous(),
            offs=grouped_gemm.group_ends(splits), out_dtype=out_dtype,
            use_fast_accum=fast_accum)
    out = a.new_empty((tokens, n), dtype=out_dtype)
    for g, (lo, hi) in enumerate(_ranges(splits)):
        # a scale of its own: cuBLASLt refuses (NOT_SUPPORTED) a scale pointer that is not
        # 16-byte aligned, as an element of the scales vector may be
        out[lo:hi] = fp8_gemm(a[lo:hi], a_scale_inv, b[g].t(), b_scale_inv[g].clone(), None,
                              out_dtype, fast_accum)
    return out


def fp8_grouped_wgrad(dy_t: Tensor, dy_scale_inv: Tensor, x_t: Tensor, x_scale_inv: Tensor,
                      splits: Tensor, groups: int, out_dtype: torch.dtype) -> Tensor:
    """``dw[g] = dy[group g's tokens].T @ x[those tokens]`` (zeros for an empty group)
    from the transposed FP8 copies ``dy_t`` (n, tokens) and ``x_t`` (k, tokens), each
    with one scale. Every group's token count must be a multiple of 16
    (:func:`check_aligned_splits`)."""
    n, k = dy_t.shape[0], x_t.shape[0]
    backend = fp8_backend(dy_t, out_dtype)
    if backend == "triton":
        return grouped_gemm.grouped_wgrad_triton(dy_t.t(), x_t.t(), splits, groups, 64, 128,
                                                 128, scales=(dy_scale_inv, x_scale_inv),
                                                 out_dtype=out_dtype, num_warps=8)
    if backend == "torch":
        return torch._scaled_grouped_mm(
            dy_t, x_t.t(), dy_scale_inv.expand(groups * n).contiguous(),
            x_scale_inv.expand(groups * k).contiguous(), offs=grouped_gemm.group_ends(splits),
            out_dtype=out_dtype)
    dw = dy_t.new_empty((groups, n, k), dtype=out_dtype)
    for g, (lo, hi) in enumerate(_ranges(splits)):
        dw[g] = fp8_gemm(dy_t[:, lo:hi], dy_scale_inv, x_t[:, lo:hi].t(), x_scale_inv, None,
                         out_dtype)
    return dw
