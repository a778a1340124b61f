"""The way back from FP8, whatever the granularity: data times its scales, each over its
block (:func:`~fusible.quantization.casts.common.expand_scales`)."""

from __future__ import annotations

import torch

from fusible.core.inductor_fallbacks import ensure_fallback
from fusible.kernels import plain_eager
from fusible.quantization.casts.common import expand_scales


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values FP8 ``data`` with scales ``scale_inv`` stand for.

    Parameters
    ----------
    data : Tensor
        FP8 values.
    scale_inv : Tensor
        The factors that dequantize them: 0-d, or one per block of ``data`` (as many
        dimensions, the shapes saying which block each covers).
    dtype : torch.dtype
        The dtype of the result.

    Returns
    -------
    Tensor
        ``data * scale_inv`` computed in float32, then in ``dtype``, contiguous.

    Notes
    -----
    Where something may be tracing, it runs as the custom op ``fusible::dequantize``.
    """
    if plain_eager(data, scale_inv):
        return _dequantize_eager(data, scale_inv, dtype)
    return _OP(data, scale_inv, dtype)


def _dequantize_eager(data: torch.Tensor, scale_inv: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * expand_scales(scale_inv.float(), data.shape)).to(dtype).contiguous()


# torch.library.Library rather than torch.library.custom_op: see casts/tensorwise.py.
_LIB = torch.library.Library("fusible", "FRAGMENT")
_LIB.define("dequantize(Tensor data, Tensor scale_inv, ScalarType dtype) -> Tensor")
_LIB.impl("dequantize", lambda *args: _dequantize_eager(*args), "CompositeExplicitAutograd")


@torch.library.register_fake("fusible::dequantize", lib=_LIB)
def _(data, scale_inv, dtype):
    ensure_fallback(torch.ops.fusible.dequantize.default)  # (see core.inductor_fallbacks)
    return data.new_empty(data.shape, dtype=dtype)


_OP = torch.ops.fusible.dequantize.default
