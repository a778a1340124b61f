"""What every granularity's cast shares: the FP8 range, the scale an amax gives, the
blocks a tensor's scales cover, and the parts a cast op returns."""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 scale that maps ``amax`` to the largest finite value of ``fp8_dtype``.

    Finite inputs give finite data and scales: the scale stops at the largest float32
    (a tensor of tiny values), and an all-zero or empty tensor gets scale 1. Non-finite
    inputs make everything NaN, loudly: a NaN amax gives a NaN scale (all data NaN), an
    inf amax scale 0 and ``scale_inv`` inf (every dequantized value NaN).
    """
    amax = amax.float()
    # A true division (``scalar / tensor`` would multiply by a rounded reciprocal), as
    # the Triton kernel computes it; clamp keeps NaN.
    scale = (amax.new_full((), FP8_MAX[fp8_dtype]) / amax).clamp(max=FLOAT32_MAX)
    return torch.where(amax == 0, torch.ones_like(amax), scale)


def saturate(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``v`` (scaled float32 values) clamped to the finite range of ``fp8_dtype``, NaN kept
    and infinities made NaN, so that non-finite values reach the FP8 data as they do under
    current scaling: a scale from history (delayed scaling) must not turn an overflow to
    inf into the largest finite value. (NaN, as E4M3 has no infinity and the GPU's
    conversions saturate one.) ``kernels.fp8_cast.saturate`` is the kernels' twin."""
    limit = FP8_MAX[fp8_dtype]
    return torch.where(v.isinf(), torch.full_like(v, float("nan")), v.clamp(-limit, limit))


def check_cast(op: str, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool) -> None:
    """ValueError, naming the cast ``op``, for a dtype that is not FP8 or a cast that would
    keep neither the data nor its transposed copy."""
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"{op}: fp8_dtype must be one of {list(FP8_MAX)}, got {fp8_dtype}")
    if not (rowwise or columnwise):
        raise ValueError(f"{op}: asked for neither the data nor its transpose")


def pack_parts(parts: list) -> list:
    """``[data, scale_inv, transpose, transpose_scale_inv]`` without its Nones: what a
    cast op returns (a ``Tensor[]`` holds no None)."""
    return [t for t in parts if t is not None]


def unpack_parts(flat, rowwise: bool, columnwise: bool) -> list:
    """Undo :func:`pack_parts` for a cast that kept the data (``rowwise``) and / or the
    transposed copy (``columnwise``), each with its scales."""
    flat = list(flat)
    return ((flat[:2] if rowwise else [None, None])
            + (flat[-2:] if columnwise else [None, None]))


def scale_blocks(scale_shape, shape) -> tuple:
    """The block one scale covers along each dimension of a tensor of ``shape`` with scales
    of ``scale_shape`` (as many dimensions, or none: one scale): the whole dimension
    where there is one scale, else the power of two that tiles it into that many blocks
    (blocks are powers of two, the last one possibly partial, so the shapes say which)."""
    if len(scale_shape) == 0:
        return tuple(shape)
    if len(scale_shape) != len(shape):
        raise ValueError(f"scales of shape {tuple(scale_shape)} do not block a tensor of "
                         f"shape {tuple(shape)}")
    return tuple(n if s == 1 else 1 << max(0, -(-n // s) - 1).bit_length()
                 for s, n in zip(scale_shape, shape))


def expand_scales(scale_inv: torch.Tensor, shape) -> torch.Tensor:
    """``scale_inv`` repeated over its blocks so that it broadcasts against ``shape``."""
    if scale_inv.dim() == 0:
        return scale_inv
    for dim, (s, n) in enumerate(zip(scale_inv.shape, shape)):
        if s not in (1, n):
            block = scale_blocks(scale_inv.shape, shape)[dim]
            scale_inv = scale_inv.repeat_interleave(block, dim).narrow(dim, 0, n)
    return scale_inv
