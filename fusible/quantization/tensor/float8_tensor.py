"""Float8Tensor: FP8 data with its scales, posing as a tensor of its original dtype.

The class alone. What it does with each op is its op table's (``ops.py``), and the
functions that quantize into Float8Tensors are ``quantize.py``'s: both build
Float8Tensors, so they import this module, and the class reaches them through the
:class:`Hooks` that ``fusible/quantization/tensor/__init__.py`` sets when it loads them
(before anything can import the class).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional, Union

import attrs
import torch

from fusible.quantization.casts.dequantize import dequantize


@attrs.frozen
class Hooks:
    """What Float8Tensor calls in the modules above it."""

    dispatch: Callable  # (func, args, kwargs): __torch_dispatch__, ops.dispatch
    requantize: Callable  # (t, fp8_dtype, columnwise): quantize.requantize
    quantize: Callable  # (x, fp8_dtype): per-tensor current scaling, quantize.quantize_raw


class Float8Tensor(torch.Tensor):
    """FP8 data, its inverse scales and the original dtype; optionally a transposed copy.

    The tensor has the shape and (outer) dtype of the tensor it quantizes, so it
    can stand where that tensor stood. ``_data`` holds the FP8 values, ``_scale_inv`` the
    factors that dequantize them (float32, or E8M0 for MX): 0-d, one per tensor; or as
    many dimensions as the data, one per block, the shapes saying which block each covers
    (``casts.common.scale_blocks``: ``(..., rows, 1)`` per row, ``(1, cols)`` per column
    of a row-scaled tensor seen transposed, ``(rows, ceil(cols / 128))`` per 1x128 tile,
    ...). ``_transpose`` is an optional row-major (features, tokens) copy for the GEMM
    that needs the other layout (Hopper's FP8 GEMMs need both operands K-major),
    dequantized by ``_transpose_scale_inv`` (None: ``_scale_inv``, the per-tensor case; a
    copy scaled per row or tile of its own layout has its own).

    GEMMs between Float8Tensors run as FP8 GEMMs (``quantization.gemm.scaled_gemm``);
    views, transposes, detach and clone stay in FP8; any other op dequantizes and runs in
    the original dtype (the op table: ``quantization/tensor/ops.py``). :meth:`dequantize`
    is differentiable, and its backward sends an E5M2 Float8Tensor, so that the gradient
    of a Float8Tensor is always one (see ``shared/DESIGN.md``).
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _transpose: Optional[torch.Tensor]
    _transpose_scale_inv: Optional[torch.Tensor]
    _a_view: bool  # set on views only (_marked_view)
    _hooks: ClassVar[Hooks]  # set by fusible/quantization/tensor/__init__.py

    @staticmethod
    def __new__(cls, data, scale_inv, dtype, transpose=None, requires_grad=False,
                transpose_scale_inv=None):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)
        self._data, self._scale_inv, self._transpose = data, scale_inv, transpose
        self._transpose_scale_inv = transpose_scale_inv
        return self

    @property
    def transpose_scale_inv(self) -> torch.Tensor:
        """The factors that dequantize the transposed copy."""
        return self._scale_inv if self._transpose_scale_inv is None else self._transpose_scale_inv

    @property
    def per_tensor(self) -> bool:
        """Whether one scale serves the whole tensor (and its transposed copy)."""
        return self._scale_inv.dim() == 0 and self._transpose_scale_inv is None

    @property
    def fp8_dtype(self) -> torch.dtype:
        """``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
        return self._data.dtype

    @property
    def scale_inv(self) -> torch.Tensor:
        """The factors that dequantize the data (0-d, or one per block)."""
        return self._scale_inv

    def __repr__(self) -> str:  # type: ignore[override]  # mypy bug: kw-only dunder args
        scale = (f"{tuple(self._scale_inv.shape)} scales" if self._scale_inv.dim()
                 else self._scale_inv.item() if not _is_fake(self._scale_inv) else "?")
        return (f"Float8Tensor({self.fp8_dtype}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"scale_inv={scale}, transpose={self._transpose is not None})")

    def __tensor_flatten__(self):
        inner = ["_data", "_scale_inv"] + (["_transpose"] if self._transpose is not None else [])
        if self._transpose_scale_inv is not None:
            inner.append("_transpose_scale_inv")
        return inner, (self.dtype, self.fp8_dtype, self._transpose is not None)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta[0], inner.get("_transpose"),
                            transpose_scale_inv=inner.get("_transpose_scale_inv"))

    def dequantize(self) -> torch.Tensor:
        """The values in the original dtype; differentiable (its backward quantizes to E5M2)."""
        return _Dequantize.apply(self)

    def _dequantize_raw(self) -> torch.Tensor:
        return dequantize(self._data, self._scale_inv, self.dtype)

    def __coerce_tangent_metadata__(self):
        """The gradient a compiled backward is traced with: E5M2, as dequantize() sends."""
        return self._hooks.requantize(self, torch.float8_e5m2, False)

    def __coerce_same_metadata_as_tangent__(self, expected_meta, expected_type=None):
        """Turn a gradient into what a compiled backward expects: a plain tensor, or a
        Float8Tensor of the expected FP8 dtype (requantized) and layout."""
        if expected_type is not None and expected_type is not Float8Tensor:
            return self._dequantize_raw()
        _, fp8_dtype, columnwise = expected_meta
        return self._hooks.requantize(self, fp8_dtype, columnwise)

    __torch_function__ = (
        torch._C._disabled_torch_function_impl)  # type: ignore[assignment]  # torch's idiom

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls._hooks.dispatch(func, args, kwargs or {})


class _Dequantize(torch.autograd.Function):
    """Float8Tensor -> tensor; the gradient goes back quantized to E5M2."""

    @staticmethod
    def forward(ctx, t: Float8Tensor):
        return t._dequantize_raw()

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, Float8Tensor):
            return grad
        return Float8Tensor._hooks.quantize(grad.contiguous(), torch.float8_e5m2)


def _is_fake(t) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor)


# A quantized_model_init model's state dict holds Float8Tensors: torch.load's default
# (weights_only=True) may rebuild them, their state being tensors and dtypes only.
torch.serialization.add_safe_globals([Float8Tensor])

# A field type for args that may carry either a tensor or a Float8Tensor; custom ops
# receive it as (data or tensor, scale_inv, transposed copy, original dtype).
Fp8Able = Union[torch.Tensor, Float8Tensor]
