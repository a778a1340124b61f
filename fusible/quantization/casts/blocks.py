"""FP8 casts with one scale per block of a 2-D tensor: ``1 x G`` tiles along the rows
(DeepSeek-V3's 1x128 activations, MXFP8's 1x32) or ``G x G`` blocks (its 128x128
weights), each block scaled by its own absolute maximum (current scaling) or by the
power of two at or above it (MX: E8M0 scales).

A block's scale follows :func:`fusible.quantization.casts.common.scale_from_amax`'s
rules; a power-of-two one is ``2^ceil(log2(amax / FP8_MAX))`` (the OCP MX scale rounded
up, so that no value saturates), 1 for an all-zero block, NaN where the block holds a NaN or
an inf. Ragged edges are partial blocks. On CUDA one Triton kernel writes the data and
the transposed copy from one read of ``x`` (:mod:`fusible.kernels.fp8_blocks`);
elsewhere PyTorch ops with the same arithmetic, the same bits. Under tracing the cast
is the custom op ``fusible::cast_to_fp8_blocks``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusible.core.inductor_fallbacks import ensure_fallback
from fusible.kernels import fp8_blocks, fp8_cast, plain_eager
from fusible.quantization.casts.common import (FP8_MAX, check_cast, pack_parts, saturate,
                                               scale_from_amax, unpack_parts)

E8M0 = torch.float8_e8m0fnu


def cast_blocks(x2: torch.Tensor, fp8_dtype: torch.dtype, group: int, square: bool,
                power2: bool, rowwise: bool = True, columnwise: bool = False) -> list:
    """Cast the 2-D ``x2`` (R, C) to FP8 with one scale per block.

    Parameters
    ----------
    x2 : Tensor
        2-D, (R, C).
    fp8_dtype : torch.dtype
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    group : int
        The block's side: 128 (DeepSeek-V3's blocks), 32 (MX).
    square : bool
        ``group x group`` blocks; the transposed copy is the data transposed, its scales
        the same transposed. Otherwise ``1 x group`` tiles along the rows; the
        transposed copy tiled along its own rows (``group`` rows of ``x2``), as a GEMM
        contracting over the rows needs.
    power2 : bool
        Power-of-two scales, stored as E8M0 (MX); otherwise float32.
    rowwise : bool
        Keep the data (and its scales).
    columnwise : bool
        Write the (C, R) row-major transposed copy with its own scales.

    Returns
    -------
    list
        ``[data, scale_inv, transpose, transpose_scale_inv]``, None where not asked for;
        ``scale_inv`` (ceil(R / group) or R, ceil(C / group)), the copy's likewise.

    Notes
    -----
    Where something may be tracing, it runs as the custom op
    ``fusible::cast_to_fp8_blocks``.
    """
    check_cast("cast_to_fp8_blocks", fp8_dtype, rowwise, columnwise)
    if x2.dim() != 2:
        raise ValueError(f"cast_to_fp8_blocks: takes a 2-D tensor, got shape {tuple(x2.shape)}")
    if not plain_eager(x2):
        out = _OP(x2, fp8_dtype, group, square, power2, rowwise, columnwise)
        return unpack_parts(out, rowwise, columnwise)
    return _cast(x2, fp8_dtype, group, square, power2, rowwise, columnwise)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _power2_scale_inv(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``2^ceil(log2(amax / FP8_MAX))`` in float32, from the bits of the quotient (exact,
    as the kernel computes it): 1 for 0, ``2^-127`` at least, NaN for a NaN or inf amax."""
    v = amax.float() / amax.new_full((), FP8_MAX[fp8_dtype], dtype=torch.float32)
    bits = v.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    e = biased - 127 + (mantissa != 0).to(torch.int32)
    # a subnormal quotient: 2^-126 above 2^-127, else 2^-127 (E8M0's least)
    subnormal = torch.where(mantissa > 0x400000, torch.full_like(e, -126), torch.full_like(e, -127))
    e = torch.where(biased == 0, subnormal, e).clamp(-127, 127)
    scale_inv = torch.ldexp(torch.ones_like(v), e)
    scale_inv = torch.where(amax == 0, torch.ones_like(v), scale_inv)
    return torch.where(torch.isfinite(amax), scale_inv, torch.full_like(v, float("nan")))


def _block_scales(amax: torch.Tensor, fp8_dtype: torch.dtype, power2: bool) -> tuple:
    """``(scale, scale_inv)`` of blocks with absolute maxima ``amax`` (float32)."""
    if power2:
        scale_inv = _power2_scale_inv(amax, fp8_dtype)
        return torch.ones_like(scale_inv) / scale_inv, scale_inv
    scale = scale_from_amax(amax, fp8_dtype)
    return scale, torch.ones_like(scale) / scale


def _cast_blocks_torch(x2: torch.Tensor, fp8_dtype: torch.dtype, block: tuple,
                       power2: bool = False) -> tuple:
    """``(data, scale_inv)``: the 2-D ``x2`` (R, C) cast with one scale per ``block``
    ``(rows, cols)``; ``scale_inv`` (ceil(R / rows), ceil(C / cols)), float32 (E8M0 with
    ``power2``)."""
    rows, cols = x2.shape
    br, bc = block
    nr, nc = _cdiv(rows, br), _cdiv(cols, bc)
    xf = F.pad(x2.float(), (0, nc * bc - cols, 0, nr * br - rows))
    tiles = xf.view(nr, br, nc, bc)
    if tiles.numel():
        amax = tiles.abs().amax(dim=(1, 3))
    else:
        amax = xf.new_zeros((nr, nc))
    scale, scale_inv = _block_scales(amax, fp8_dtype, power2)
    data = saturate(tiles * scale[:, None, :, None], fp8_dtype).to(fp8_dtype)
    data = data.view(nr * br, nc * bc)[:rows, :cols].contiguous()
    return data, scale_inv.to(E8M0) if power2 else scale_inv


def _cast(x2, fp8_dtype, group, square, power2, rowwise, columnwise) -> list:
    if x2.is_cuda and fp8_cast.triton is not None and x2.numel():
        return fp8_blocks.cast_blocks_triton(x2, fp8_dtype, FP8_MAX[fp8_dtype], group, square,
                                             power2, rowwise, columnwise)
    return _cast_torch(x2, fp8_dtype, group, square, power2, rowwise, columnwise)


def _cast_torch(x2, fp8_dtype, group, square, power2, rowwise, columnwise) -> list:
    out: list[torch.Tensor | None] = [None] * 4
    block = (group, group) if square else (1, group)
    if rowwise or square:
        out[0], out[1] = _cast_blocks_torch(x2, fp8_dtype, block, power2)
    if columnwise and square:
        data, scale = out[0], out[1]
        assert data is not None and scale is not None  # cast above (square)
        out[2], out[3] = fp8_cast.transposed_copy(data), scale.t().contiguous()
    elif columnwise:
        out[2], out[3] = _cast_blocks_torch(x2.t(), fp8_dtype, block, power2)
    if not rowwise:
        out[0] = out[1] = None
    return out


_LIB = torch.library.Library("fusible", "FRAGMENT")
_LIB.define("cast_to_fp8_blocks(Tensor x, ScalarType fp8_dtype, int group, bool square, "
            "bool power2, bool rowwise, bool columnwise) -> Tensor[]")
_LIB.impl("cast_to_fp8_blocks",
          lambda x, *args: pack_parts(_cast(x.contiguous(), *args)), "CompositeExplicitAutograd")


@torch.library.register_fake("fusible::cast_to_fp8_blocks", lib=_LIB)
def _(x, fp8_dtype, group, square, power2, rowwise, columnwise):
    ensure_fallback(torch.ops.fusible.cast_to_fp8_blocks.default)  # (see core.inductor_fallbacks)
    rows, cols = x.shape
    nr = _cdiv(rows, group) if square else rows
    scale_dtype = E8M0 if power2 else torch.float32
    out = []
    if rowwise:
        out += [x.new_empty((rows, cols), dtype=fp8_dtype),
                x.new_empty((nr, _cdiv(cols, group)), dtype=scale_dtype)]
    if columnwise:
        t_rows = _cdiv(cols, group) if square else cols
        out += [x.new_empty((cols, rows), dtype=fp8_dtype),
                x.new_empty((t_rows, _cdiv(rows, group)), dtype=scale_dtype)]
    return out


_OP = torch.ops.fusible.cast_to_fp8_blocks.default
