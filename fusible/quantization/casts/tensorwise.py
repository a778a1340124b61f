"""FP8 casts with per-tensor current scaling, as a custom op so that eager and compiled
runs compute the same scales and the same bits.

On CUDA with Triton the cast is two Triton kernels (``fusible.kernels.fp8_cast``);
elsewhere, PyTorch ops with the same arithmetic.
"""

from __future__ import annotations

import torch

from fusible.core.inductor_fallbacks import ensure_fallback
from fusible.kernels import fp8_cast, plain_eager
from fusible.quantization.casts.common import FP8_MAX, saturate, scale_from_amax


def cast_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                    amax: torch.Tensor | None = None, rowwise: bool = True) -> list:
    """Cast ``x`` to FP8 with one scale for the whole tensor: ``data = saturate(x *
    scale)``, ``scale`` mapping ``x``'s absolute maximum to ``fp8_dtype``'s largest value
    (:func:`~fusible.quantization.casts.common.scale_from_amax`).

    Parameters
    ----------
    x : Tensor
        Any shape, seen as (tokens, features) for the transposed copy.
    fp8_dtype : torch.dtype
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    columnwise : bool
        Also write ``transpose``, the (features, tokens) row-major copy of the data: the
        layout a GEMM needs for the other operand side.
    amax : Tensor, optional
        float32, 0-d: replaces ``x``'s own absolute maximum (the maximum over a process
        group, so that every rank quantizes its part with one scale; the one a forward
        measured, so that the backward casts alike).
    rowwise : bool
        False (with ``columnwise``): the transposed copy alone, the data not kept (on
        CUDA from bfloat16 never written): what dgrad reads of a weight.

    Returns
    -------
    list
        ``[data, scale_inv]`` (``x``'s shape, 0-d float32), ``+ [transpose]`` with
        ``columnwise``; ``[transpose, scale_inv]`` without ``rowwise``. One scale serves
        the data and its copy.

    Notes
    -----
    Where something may be tracing, it runs as the custom op ``fusible::cast_to_fp8``.
    """
    if plain_eager(x) and (amax is None or plain_eager(amax)):
        return _cast_eager(x, fp8_dtype, columnwise, amax, rowwise)
    return _OP(x, fp8_dtype, columnwise, amax, rowwise)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``x``'s absolute maximum, float32 0-d (0 when empty; NaN if any is NaN): the amax
    :func:`cast_tensorwise` scales by. A maximum is exact, so every kernel gives the same
    bits, and handing it back to :func:`cast_tensorwise` quantizes as it would alone."""
    if x.is_cuda and fp8_cast.triton is not None and x.numel() and plain_eager(x):
        return fp8_cast.amax_triton(x)
    return _amax_of_float(x.detach().float())


def cast_tensorwise_torch(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                          amax: torch.Tensor | None = None) -> list:
    """:func:`cast_tensorwise` in PyTorch ops (the bits of its kernels); ``amax`` may also
    have a shape that broadcasts against ``x`` (one per batch or row: each its own scale,
    ``scale_inv`` of that shape), what the row-wise and grouped casts build on."""
    xf = x.float().contiguous()  # contiguous outputs, whatever the input's strides
    if amax is None:
        amax = _amax_of_float(xf)
    scale = scale_from_amax(amax, fp8_dtype)
    data = saturate(xf * scale, fp8_dtype).to(fp8_dtype)
    out = [data, torch.ones_like(scale) / scale]
    if columnwise:
        out.append(fp8_cast.transposed_copy(data))
    return out


def _cast_eager(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                amax: torch.Tensor | None = None, rowwise: bool = True) -> list:
    """:func:`cast_tensorwise` on real tensors (the custom op's kernel): the Triton
    kernels on CUDA, else :func:`cast_tensorwise_torch`."""
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"cast_to_fp8: fp8_dtype must be one of {list(FP8_MAX)}, got {fp8_dtype}")
    _check_kept(rowwise, columnwise)
    if x.is_cuda and fp8_cast.triton is not None and x.numel() > 0:
        return fp8_cast.cast_to_fp8_triton(x, fp8_dtype, FP8_MAX[fp8_dtype], columnwise,
                                           amax=amax, rowwise=rowwise)
    out = cast_tensorwise_torch(x, fp8_dtype, columnwise, amax)
    return out if rowwise else [out[2], out[1]]


def _check_kept(rowwise: bool, columnwise: bool) -> None:
    """The real op and its fake refuse alike a cast that would keep nothing."""
    if not (rowwise or columnwise):
        raise ValueError("cast_to_fp8: rowwise=False needs columnwise=True (else nothing is "
                         "kept)")


def _amax_of_float(xf: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of the float32 ``xf``; 0 when empty (zero tokens)."""
    return xf.abs().amax() if xf.numel() else xf.new_zeros(())


# Defined on torch.library.Library rather than with torch.library.custom_op: no autograd
# formula is needed (they run inside fusible's own autograd nodes and stage ops), and
# custom_op's Python wrappers cost about 25 us more a call on a CPU host, on every weight
# cast of a compiled FP8 step.
_LIB = torch.library.Library("fusible", "FRAGMENT")
_LIB.define("cast_to_fp8(Tensor x, ScalarType fp8_dtype, bool columnwise, Tensor? amax=None, "
            "bool rowwise=True) -> Tensor[]")
_LIB.impl("cast_to_fp8", fp8_cast.fresh_zeros_inside(lambda *args: _cast_eager(*args)),
          "CompositeExplicitAutograd")


@torch.library.register_fake("fusible::cast_to_fp8", lib=_LIB)
def _(x, fp8_dtype, columnwise, amax=None, rowwise=True):
    ensure_fallback(torch.ops.fusible.cast_to_fp8.default)  # (see core.inductor_fallbacks)
    _check_kept(rowwise, columnwise)
    scale_inv = x.new_empty((), dtype=torch.float32)
    if not columnwise:
        return [x.new_empty(x.shape, dtype=fp8_dtype), scale_inv]
    transpose = x.new_empty((x.shape[-1], x.numel() // x.shape[-1]), dtype=fp8_dtype)
    if not rowwise:
        return [transpose, scale_inv]
    return [x.new_empty(x.shape, dtype=fp8_dtype), scale_inv, transpose]


_OP = torch.ops.fusible.cast_to_fp8.default
