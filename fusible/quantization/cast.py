"""FP8 casts with per-tensor current scaling, as custom ops so that eager and compiled
runs compute the same scales and the same bits.

On CUDA with Triton the cast is two Triton kernels (``fusible.kernels.fp8_cast``);
elsewhere, PyTorch ops with the same arithmetic.
"""

from __future__ import annotations

import math

import torch

from fusible.kernels import fp8_cast, fp8_rowwise, plain_eager

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


def cast_to_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                amax: torch.Tensor | None = None, rowwise: bool = True) -> list:
    """``[data, scale_inv]`` (+ ``transpose``): ``data = saturate(x * scale)`` in FP8.

    ``transpose`` is the (features, tokens) row-major copy of the data seen as
    (tokens, features), the layout a GEMM needs for the other operand side.
    ``amax`` (float32, 0-d) replaces ``x``'s own absolute maximum, e.g. the maximum
    over a process group, so that every rank quantizes its part with one scale.
    ``rowwise=False`` (with ``columnwise``): ``[transpose, scale_inv]`` alone, the data
    not kept (on CUDA from bfloat16 never written): what dgrad reads of a weight.
    """
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"cast_to_fp8: fp8_dtype must be one of {list(FP8_MAX)}, got {fp8_dtype}")
    _check_kept(rowwise, columnwise)
    if x.is_cuda and fp8_cast.triton is not None and x.numel() > 0:
        return fp8_cast.cast_to_fp8_triton(x, fp8_dtype, FP8_MAX[fp8_dtype], columnwise,
                                           amax=amax, rowwise=rowwise)
    out = cast_to_fp8_torch(x, fp8_dtype, columnwise, amax)
    return out if rowwise else [out[2], out[1]]


def _check_kept(rowwise: bool, columnwise: bool) -> None:
    """The real op and its fake refuse alike a cast that would keep nothing."""
    if not (rowwise or columnwise):
        raise ValueError("cast_to_fp8: rowwise=False needs columnwise=True (else nothing is "
                         "kept)")


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``x``'s absolute maximum, float32 0-d (0 when empty; NaN if any is NaN): the amax
    :func:`cast_to_fp8` scales by. A maximum is exact, so every kernel gives the same
    bits, and handing it back to :func:`cast_to_fp8` quantizes as it would alone."""
    if x.is_cuda and fp8_cast.triton is not None and x.numel() and plain_eager(x):
        return fp8_cast.amax_triton(x)
    return _amax_of_float(x.detach().float())


def _amax_of_float(xf: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of the float32 ``xf``; 0 when empty (zero tokens)."""
    return xf.abs().amax() if xf.numel() else xf.new_zeros(())


def cast_to_fp8_torch(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                      amax: torch.Tensor | None = None) -> list:
    """:func:`cast_to_fp8` in PyTorch ops; ``amax`` may also have a shape that broadcasts
    against ``x`` (one per batch: each batch's own scale, ``scale_inv`` of that shape)."""
    xf = x.float().contiguous()  # contiguous outputs, whatever the input's strides
    if amax is None:
        amax = _amax_of_float(xf)
    scale = scale_from_amax(amax, fp8_dtype)
    limit = FP8_MAX[fp8_dtype]
    data = (xf * scale).clamp_(-limit, limit).to(fp8_dtype)
    out = [data, torch.ones_like(scale) / scale]
    if columnwise:
        out.append(fp8_cast.transposed_copy(data))
    return out


def cast_to_fp8_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = True,
                        columnwise: bool = False,
                        column_amax: torch.Tensor | None = None) -> list:
    """``[data, scale_inv, transpose, transpose_scale_inv]`` with one scale per row: ``x``
    seen as (tokens, features); ``data`` (``x``'s shape) scaled per token, ``scale_inv``
    (tokens, 1); ``transpose`` the (features, tokens) row-major copy scaled per row of its
    own layout (per feature), ``transpose_scale_inv`` (features, 1): what a GEMM
    contracting over the tokens needs. None where not asked for. Each row follows
    :func:`scale_from_amax`'s rules with its own amax (a NaN stays in its row).
    ``column_amax`` (float32, features) replaces the copy's own maxima: the maxima over a
    process group, so that every rank casts its tokens with the group's scales.
    On CUDA Triton kernels (``fusible.kernels.fp8_rowwise``: the data alone in one, both
    layouts in two), elsewhere PyTorch ops, the same bits.
    """
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"cast_to_fp8_rowwise: fp8_dtype must be one of {list(FP8_MAX)}, got "
                         f"{fp8_dtype}")
    if not (rowwise or columnwise):
        raise ValueError("cast_to_fp8_rowwise: asked for neither the data nor its transpose")
    if not plain_eager(x) or (column_amax is not None and not plain_eager(column_amax)):
        # traced: the op (its fake gives the shapes, no kernel launch)
        flat = cast_to_fp8_rowwise_op(x, fp8_dtype, rowwise, columnwise, column_amax)
        return unpack_parts(flat, rowwise, columnwise)
    return _cast_rowwise(x, fp8_dtype, rowwise, columnwise, column_amax)


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


def _cast_rowwise(x, fp8_dtype, rowwise, columnwise, column_amax=None) -> list:
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if columnwise and x.is_cuda and fp8_cast.triton is not None:  # both layouts, two reads
        out = fp8_rowwise.cast_rows_and_columns_triton(x2, fp8_dtype, FP8_MAX[fp8_dtype],
                                                       rowwise, column_amax=column_amax)
        if rowwise:
            out[0] = out[0].view(x.shape)
        return out
    out = [None] * 4
    if rowwise:
        data, out[1] = _cast_rows(x2, fp8_dtype)
        out[0] = data.view(x.shape)
    if columnwise:
        out[2], out[3] = _cast_rows(x2.t(), fp8_dtype,
                                    None if column_amax is None else column_amax.view(-1, 1))
    return out


def _cast_rows(x2: torch.Tensor, fp8_dtype: torch.dtype, amax=None) -> tuple:
    """The rows of ``x2`` cast by their own maxima (or by ``amax``, (rows, 1))."""
    if x2.is_cuda and fp8_cast.triton is not None and amax is None:
        return fp8_rowwise.cast_rows_triton(x2, fp8_dtype, FP8_MAX[fp8_dtype])
    xf = x2.float().contiguous()
    if amax is None:
        amax = xf.abs().amax(1, keepdim=True) if xf.shape[1] else xf.new_zeros((xf.shape[0], 1))
    data, scale_inv = cast_to_fp8_torch(xf, fp8_dtype, False, amax)
    return data, scale_inv


def dequantize_fp8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv`` in ``dtype``, each scale over its block (:func:`expand_scales`)."""
    return (data.float() * expand_scales(scale_inv.float(), data.shape)).to(dtype).contiguous()


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


def cast_to_fp8_any(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool,
                    amax: torch.Tensor | None = None, rowwise: bool = True) -> list:
    """:func:`cast_to_fp8`, through its custom op wherever something may be tracing."""
    if plain_eager(x) and (amax is None or plain_eager(amax)):
        return cast_to_fp8(x, fp8_dtype, columnwise, amax, rowwise)
    return cast_to_fp8_op(x, fp8_dtype, columnwise, amax, rowwise)


def dequantize_any(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
    """:func:`dequantize_fp8`, through its custom op wherever something may be tracing."""
    if plain_eager(data, scale_inv):
        return dequantize_fp8(data, scale_inv, dtype)
    return dequantize_op(data, scale_inv, dtype)


# Defined on torch.library.Library rather than with torch.library.custom_op: no autograd
# formula is needed (they run inside fusible's own autograd nodes and stage ops), and
# custom_op's Python wrappers cost about 25 us more a call on a CPU host, on every weight
# cast of a compiled FP8 step.
_LIB = torch.library.Library("fusible", "FRAGMENT")
_LIB.define("cast_to_fp8(Tensor x, ScalarType fp8_dtype, bool columnwise, Tensor? amax=None, "
            "bool rowwise=True) -> Tensor[]")
_LIB.define("dequantize(Tensor data, Tensor scale_inv, ScalarType dtype) -> Tensor")
_LIB.define("cast_to_fp8_rowwise(Tensor x, ScalarType fp8_dtype, bool rowwise, bool columnwise, "
            "Tensor? column_amax=None) -> Tensor[]")
_LIB.impl("cast_to_fp8_rowwise", lambda *args: pack_parts(_cast_rowwise(*args)),
          "CompositeExplicitAutograd")
_LIB.impl("cast_to_fp8", fp8_cast.fresh_zeros_inside(lambda *args: cast_to_fp8(*args)),
          "CompositeExplicitAutograd")
_LIB.impl("dequantize", lambda *args: dequantize_fp8(*args), "CompositeExplicitAutograd")


@torch.library.register_fake("fusible::cast_to_fp8", lib=_LIB)
def _(x, fp8_dtype, columnwise, amax=None, rowwise=True):
    _check_kept(rowwise, columnwise)
    scale_inv = x.new_empty((), dtype=torch.float32)
    if not columnwise:
        return [x.new_empty(x.shape, dtype=fp8_dtype), scale_inv]
    transpose = x.new_empty((x.shape[-1], x.numel() // x.shape[-1]), dtype=fp8_dtype)
    if not rowwise:
        return [transpose, scale_inv]
    return [x.new_empty(x.shape, dtype=fp8_dtype), scale_inv, transpose]


@torch.library.register_fake("fusible::cast_to_fp8_rowwise", lib=_LIB)
def _(x, fp8_dtype, rowwise, columnwise, column_amax=None):
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    out = []
    if rowwise:
        out += [x.new_empty(x.shape, dtype=fp8_dtype),
                x.new_empty((rows, 1), dtype=torch.float32)]
    if columnwise:
        out += [x.new_empty((cols, rows), dtype=fp8_dtype),
                x.new_empty((cols, 1), dtype=torch.float32)]
    return out


@torch.library.register_fake("fusible::dequantize", lib=_LIB)
def _(data, scale_inv, dtype):
    return data.new_empty(data.shape, dtype=dtype)


cast_to_fp8_op = torch.ops.fusible.cast_to_fp8.default
dequantize_op = torch.ops.fusible.dequantize.default
cast_to_fp8_rowwise_op = torch.ops.fusible.cast_to_fp8_rowwise.default
