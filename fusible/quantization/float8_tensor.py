"""Float8Tensor: FP8 data with its scales, posing as a tensor of its original dtype."""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.utils._pytree as pytree

from fusible.quantization import cast
from fusible.quantization.gemm import scaled_gemm
from fusible.quantization.scaling import Scaling, scaling_named, scaling_of

aten = torch.ops.aten


class Float8Tensor(torch.Tensor):
    """FP8 data, its inverse scales and the original dtype; optionally a transposed copy.

    The tensor has the shape and (outer) dtype of the tensor it quantizes, so it
    can stand where that tensor stood. ``_data`` holds the FP8 values, ``_scale_inv`` the
    factors that dequantize them (float32, or E8M0 for MX): 0-d, one per tensor; or as
    many dimensions as the data, one per block, the shapes saying which block each covers
    (``cast.scale_blocks``: ``(..., rows, 1)`` per row, ``(1, cols)`` per column of a
    row-scaled tensor seen transposed, ``(rows, ceil(cols / 128))`` per 1x128 tile, ...).
    ``_transpose`` is an optional row-major (features, tokens) copy for the GEMM that needs
    the other layout (Hopper's FP8 GEMMs need both operands K-major), dequantized by
    ``_transpose_scale_inv`` (None: ``_scale_inv``, the per-tensor case; a copy scaled
    per row or tile of its own layout has its own).

    GEMMs between Float8Tensors run as FP8 GEMMs (``quantization.gemm.scaled_gemm``);
    views, transposes, detach and clone stay in FP8; any other op dequantizes and runs in
    the original dtype. :meth:`dequantize` is differentiable, and its backward sends an
    E5M2 Float8Tensor, so that the gradient of a Float8Tensor is always one (see
    ``shared/DESIGN.md``).
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _transpose: Optional[torch.Tensor]
    _transpose_scale_inv: Optional[torch.Tensor]
    _a_view: bool  # set on views only (_marked_view)

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
        return cast.dequantize_any(self._data, self._scale_inv, self.dtype)

    def __coerce_tangent_metadata__(self):
        """The gradient a compiled backward is traced with: E5M2, as dequantize() sends."""
        return requantize(self, torch.float8_e5m2, False)

    def __coerce_same_metadata_as_tangent__(self, expected_meta, expected_type=None):
        """Turn a gradient into what a compiled backward expects: a plain tensor, or a
        Float8Tensor of the expected FP8 dtype (requantized) and layout."""
        if expected_type is not None and expected_type is not Float8Tensor:
            return self._dequantize_raw()
        _, fp8_dtype, columnwise = expected_meta
        return requantize(self, fp8_dtype, columnwise)

    __torch_function__ = (
        torch._C._disabled_torch_function_impl)  # type: ignore[assignment]  # torch's idiom

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        written = _written_float8(func, args, kwargs)
        if written:
            return _run_in_place(func, args, kwargs, written)
        # Anything else: dequantize and run in the original dtype. Never through
        # super().__torch_dispatch__, which would bypass fake and functional tensors.
        args, kwargs = pytree.tree_map_only(Float8Tensor, Float8Tensor._dequantize_raw,
                                            (args, kwargs))
        return func(*args, **kwargs)


def _written_float8(func, args, kwargs) -> list:
    """The Float8Tensors an op writes into (its schema's ``Tensor(a!)`` arguments:
    ``add_``, ``copy_``, ``uniform_``, an optimizer's ``_foreach_*_``)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, Float8Tensor):
                written.append(t)
    return written


def _run_in_place(func, args, kwargs, written: list):
    """An op that writes into Float8Tensors: run on their values in the original dtype,
    then each quantized again in place (a new current scale; its data, scale and
    transposed copy overwritten, so whoever holds it, an optimizer its parameter, sees
    the new values). Returns what the op returns, with the Float8Tensors in place of
    their high-precision stand-ins."""
    for t in written:
        # A view (even of all of it) shares the bytes but not the transposed copy the
        # original keeps, which the write would leave stale; part of it would rescale all.
        if getattr(t, "_a_view", False) or t._data.untyped_storage().nbytes() != t._data.numel():
            raise NotImplementedError(
                f"{func}: writing into a view or part of a Float8Tensor (shape "
                f"{tuple(t.shape)}) would leave the rest of it, or its transposed copy, "
                f"stale: write into the tensor itself, or dequantize it first")
    stand_in = {id(t): t._dequantize_raw() for t in written}

    def high(t):
        return stand_in.get(id(t)) if id(t) in stand_in else t._dequantize_raw()

    args2, kwargs2 = pytree.tree_map_only(Float8Tensor, high, (args, kwargs))
    out = func(*args2, **kwargs2)
    for t in written:
        _quantize_into(t, stand_in[id(t)])
    back = {id(v): t for t in written for v in (stand_in[id(t)],)}
    return pytree.tree_map_only(torch.Tensor, lambda v: back.get(id(v), v), out)


def _quantize_into(t: "Float8Tensor", values: torch.Tensor) -> None:
    """Overwrite ``t`` with ``values`` quantized to its FP8 dtype, layout and scaling."""
    if t.per_tensor:
        parts = cast.cast_to_fp8_any(values.contiguous(), t.fp8_dtype, t._transpose is not None)
    else:
        q = quantize_scaled(values, scaling_of(t._data, t._scale_inv), t.fp8_dtype,
                            t._transpose is not None)
        parts = [q._data, q._scale_inv, q._transpose, q._transpose_scale_inv]
    t._data.copy_(parts[0].view(t._data.shape))
    t._scale_inv.copy_(parts[1].view(t._scale_inv.shape))
    if t._transpose is not None:
        t._transpose.copy_(parts[2])
    if t._transpose_scale_inv is not None:
        t._transpose_scale_inv.copy_(parts[3])


class _Dequantize(torch.autograd.Function):
    """Float8Tensor -> tensor; the gradient goes back quantized to E5M2."""

    @staticmethod
    def forward(ctx, t: Float8Tensor):
        return t._dequantize_raw()

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, Float8Tensor):
            return grad
        return quantize_raw(grad.contiguous(), torch.float8_e5m2)


def _is_fake(t) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor)


def from_cast_parts(parts: list, dtype: torch.dtype) -> Float8Tensor:
    """The Float8Tensor of a cast kernel's ``[data, scale_inv] (+ transposed copy)``,
    dequantizing to ``dtype``."""
    data, scale_inv, *transpose = parts
    return Float8Tensor(data, scale_inv, dtype, transpose[0] if transpose else None)


def transposed_only(transpose: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                    shape=None) -> Float8Tensor:
    """A Float8Tensor holding only the transposed copy (its data is a view of it, in
    ``shape``, default 2-D): what the backward GEMMs read of a saved input or weight, at
    half the memory."""
    data = transpose.t()
    if scale_inv.dim():  # the copy's own scales: seen transposed, the data's
        if shape is not None and len(shape) != 2 and tuple(scale_inv.shape) != (data.shape[1], 1):
            raise NotImplementedError(f"a {len(shape)}-D FP8 tensor held by a transposed copy "
                                      f"with block scales {tuple(scale_inv.shape)}")
        scales = scale_inv.t() if shape is None or len(shape) == 2 else \
            _per_column(scale_inv.t(), shape)  # per-row copy scales: per column, N-D
        return Float8Tensor(data if shape is None else data.view(shape), scales, dtype,
                            transpose, transpose_scale_inv=scale_inv)
    return Float8Tensor(data if shape is None else data.view(shape), scale_inv, dtype, transpose)


def quantize_raw(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                 dtype: Optional[torch.dtype] = None,
                 amax: Optional[torch.Tensor] = None, rowwise: bool = True) -> Float8Tensor:
    """Quantize with current scaling (the ``fusible::cast_to_fp8`` custom op's kernel);
    ``amax`` replaces ``x``'s own absolute maximum (see ``cast.cast_to_fp8``). Without
    ``rowwise`` only the transposed copy is kept (the data is a view of it)."""
    out = cast.cast_to_fp8_any(x, fp8_dtype, columnwise, amax, rowwise)
    if not rowwise:
        return transposed_only(out[0], out[1], dtype or x.dtype, x.shape)
    return Float8Tensor(out[0], out[1], dtype or x.dtype, out[2] if columnwise else None)


def quantize_scaled(x: torch.Tensor, scaling: Scaling, fp8_dtype: torch.dtype,
                    columnwise: bool = False, dtype: Optional[torch.dtype] = None,
                    state: Optional[torch.Tensor] = None) -> Float8Tensor:
    """``x`` (..., features) quantized with ``scaling`` (seen as (tokens, features));
    ``columnwise``: with the (features, tokens) copy scaled per block of its own layout.
    Scales per row (or per tile of a row) keep ``x``'s leading dimensions (``(..., rows,
    1)``, ``(..., rows, tiles)``); blocks of several rows need a 2-D ``x``. ``state``: a
    stateful scaling's (updated by the cast)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    data, scale_inv, transpose, t_scale_inv = scaling.cast(x2, fp8_dtype, True, columnwise,
                                                           state=state)
    if x.dim() != 2 and scale_inv.dim():
        if scale_inv.shape[0] != x2.shape[0]:
            raise NotImplementedError(f"{scaling.name} FP8 scaling of a {x.dim()}-D tensor of "
                                      f"shape {tuple(x.shape)}: its blocks span rows; quantize "
                                      f"it as (tokens, features)")
        scale_inv = scale_inv.view(*x.shape[:-1], scale_inv.shape[-1])
    return Float8Tensor(data.view(x.shape), scale_inv, dtype or x.dtype, transpose,
                        transpose_scale_inv=t_scale_inv)


def quantize_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool = False,
                     dtype: Optional[torch.dtype] = None) -> Float8Tensor:
    """``x`` (..., features) quantized with one scale per row (``scale_inv`` of shape
    ``x.shape[:-1] + (1,)``); ``columnwise``: with the (features, tokens) copy scaled per
    row of its own layout (``cast.cast_to_fp8_rowwise``)."""
    return quantize_scaled(x, scaling_named("rowwise"), fp8_dtype, columnwise, dtype)


def requantize(t: Float8Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> Float8Tensor:
    """``t`` in ``fp8_dtype`` with (or without) the transposed copy; no work when it matches."""
    if t.fp8_dtype == fp8_dtype and (t._transpose is not None) == columnwise:
        return t
    if t.fp8_dtype == fp8_dtype and not columnwise:
        return Float8Tensor(t._data, t._scale_inv, t.dtype)
    if not t.per_tensor:
        return quantize_scaled(t._dequantize_raw(), scaling_of(t._data, t._scale_inv),
                               fp8_dtype, columnwise, t.dtype)
    return quantize_raw(t._dequantize_raw(), fp8_dtype, columnwise, t.dtype)


# Handlers for the ops that stay in FP8 ------------------------------------------------

def _same(fn, copy_scale: bool = False):
    """Apply ``fn`` to the data and to the transposed copy alike (detach, clone); a clone
    copies the scales too, so that it shares no storage with ``t`` (what a custom op's
    outputs need)."""
    def handler(t, *args, **kwargs):
        transpose = None if t._transpose is None else fn(t._transpose, *args, **kwargs)

        def scale(u):
            return u.clone() if copy_scale and u is not None else u
        return Float8Tensor(fn(t._data, *args, **kwargs), scale(t._scale_inv), t.dtype,
                            transpose, transpose_scale_inv=scale(t._transpose_scale_inv))
    return handler


def _marked_view(t: "Float8Tensor") -> "Float8Tensor":
    """``t``, marked as a view of another Float8Tensor: in-place writes refuse it (they
    would leave the other's transposed copy, or the rest of it, stale)."""
    t._a_view = True
    return t


def _view(t, shape, *args):
    data = t._data.view(shape)
    same_rows = data.shape[-1] == t._data.shape[-1]
    scale_inv = t._scale_inv
    if scale_inv.dim():  # scales follow their rows' blocks; anything else dequantizes
        if not same_rows or data.dim() < 1:
            return NotImplemented
        scale_inv = _reshaped_scales(t, data.shape)
        if scale_inv is None:
            return NotImplemented
    keep = t._transpose is not None and same_rows
    return _marked_view(Float8Tensor(data, scale_inv, t.dtype, t._transpose if keep else None,
                                     transpose_scale_inv=t._transpose_scale_inv if keep
                                     else None))


def _reshape(t, shape):
    """``reshape`` (which reaches the subclass whole under tracing): a view where the
    bytes allow one, else dequantized."""
    return _view(t, shape) if t._data.is_contiguous() else NotImplemented


def _reshaped_scales(t, shape):
    """``t``'s scales for its data viewed as ``shape`` (the same last dimension): scales
    per row (or per tiles of a row) regroup with the rows; scales per column keep their
    columns; None for blocks of several rows."""
    scale_inv, old = t._scale_inv, t._data.shape
    if tuple(scale_inv.shape[:-1]) == tuple(old[:-1]):
        return scale_inv.reshape(*shape[:-1], scale_inv.shape[-1])
    if all(s == 1 for s in scale_inv.shape[:-1]) and scale_inv.shape[-1] == old[-1]:
        return _per_column(scale_inv, shape)
    return None


def _per_column(scale_inv, shape):
    """Per-column scales (``(1, ..., cols)``) for data viewed as ``shape``."""
    return scale_inv.reshape(*([1] * (len(shape) - 1)), shape[-1])


def _t(t):
    if t._transpose is not None and t._data.dim() == 2:  # the copy is the transpose, row-major
        swapped = None if t._transpose_scale_inv is None else t._scale_inv
        return _marked_view(Float8Tensor(t._transpose, t.transpose_scale_inv, t.dtype, t._data,
                                         transpose_scale_inv=swapped))
    scale_inv = t._scale_inv.t() if t._scale_inv.dim() == 2 else t._scale_inv
    if t._data.dim() != 2 and t._scale_inv.dim():
        return NotImplemented
    return _marked_view(Float8Tensor(t._data.t(), scale_inv, t.dtype))


def _as_strided(t, size, stride, storage_offset=None):
    """The identity ``as_strided`` (how FSDP2 turns a gathered tensor into the parameter)
    stays in FP8, an alias; any other dequantizes."""
    offset = t._data.storage_offset() if storage_offset is None else storage_offset
    if (tuple(size), tuple(stride), offset) != (tuple(t.shape), t._data.stride(),
                                                t._data.storage_offset()):
        return NotImplemented
    return _marked_view(Float8Tensor(t._data, t._scale_inv, t.dtype, t._transpose,
                                     transpose_scale_inv=t._transpose_scale_inv))


def _transpose(t, dim0, dim1):
    if t.dim() == 2 and {dim0 % 2, dim1 % 2} == {0, 1}:
        return _t(t)
    return NotImplemented


def _subset(fn):
    """Indexing and slicing: one per-tensor scale holds for any subset of the values, so
    the result stays in FP8 (on the bytes: advanced indexing has no FP8 kernel on every
    device); the transposed copy is dropped (the GEMM that wants one makes it). Row or
    column scales: dequantized (they would need the same indexing)."""
    def handler(t, *args, **kwargs):
        if not t.per_tensor:
            return NotImplemented
        data = fn(t._data.view(torch.uint8), *args, **kwargs).view(t._data.dtype)
        return _marked_view(Float8Tensor(data, t._scale_inv, t.dtype))
    return handler


def scaled_mm(a: Float8Tensor, b: Float8Tensor, bias=None, out_dtype=None) -> torch.Tensor:
    """``a @ b (+ bias)`` in FP8 (``a`` read row-major, ``b`` column-major): one scale
    each, one per row of ``a`` and per column of ``b`` (row-wise scaling), or scales per
    block (:func:`fusible.quantization.gemm.scaled_gemm`), each operand in whichever of
    its layouts has those (:func:`gemm_operands`)."""
    operands = gemm_operands(a, b)
    if operands is None:
        raise ValueError(f"scaled_mm: no layout of a ({tuple(a.shape)}, scales "
                         f"{tuple(a._scale_inv.shape)}) and b ({tuple(b.shape)}, scales "
                         f"{tuple(b._scale_inv.shape)}) has one scale each, one per row of "
                         f"a and per column of b, or scales per block")
    (a_data, scale_a), (b_data, scale_b) = operands
    return scaled_gemm(a_data, scale_a, b_data, scale_b, bias, out_dtype or a.dtype)


def gemm_operands(a: Float8Tensor, b: Float8Tensor):
    """``((a data, scale_a), (b data, scale_b))`` for :func:`scaled_gemm`: each operand's
    data or its transposed copy (seen transposed), whichever is scaled per tensor or
    (``a``) per row / (``b``) per column; else, for scales per block along the
    contraction, the data as it is; None otherwise (a scale per element of the
    contraction: the product is dequantized instead)."""
    m, n = a.shape[0], b.shape[1]
    a_side, b_side = _layout_scaled(a, (m, 1)), _layout_scaled(b, (1, n))
    if a_side is not None and b_side is not None:
        return a_side, b_side
    a_side, b_side = (a._data, a._scale_inv), (b._data, b._scale_inv)
    if a._data.dim() != 2 or b._data.dim() != 2 or not (a_side[1].dim() and b_side[1].dim()):
        return None
    blocks_a = cast.scale_blocks(a_side[1].shape, a_side[0].shape)
    blocks_b = cast.scale_blocks(b_side[1].shape, b_side[0].shape)
    return (a_side, b_side) if blocks_a[1] > 1 and blocks_b[0] > 1 else None


def _layout_scaled(t: Float8Tensor, shape: tuple):
    """``(data, scale)`` of the first layout of the 2-D ``t`` whose scale is 0-d or of
    ``shape``, or None."""
    layouts = [(t._data, t._scale_inv)]
    if t._transpose is not None and t._data.dim() == 2:
        scale = t.transpose_scale_inv
        layouts.append((t._transpose.t(), scale.t() if scale.dim() == 2 else scale))
    return next(((data, scale) for data, scale in layouts
                 if scale.dim() == 0 or tuple(scale.shape) == shape), None)


def _mm(a, b):
    if (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)
            and gemm_operands(a, b) is not None):
        return scaled_mm(a, b)
    return NotImplemented


def _addmm(bias, a, b, beta=1, alpha=1):
    if (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor) and beta == 1 and alpha == 1
            and not isinstance(bias, Float8Tensor) and bias.dim() == 1
            and gemm_operands(a, b) is not None):
        return scaled_mm(a, b, bias=bias)
    return NotImplemented


def _to_copy(t, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """``.to()``: another floating dtype only changes what the values dequantize to (an
    FP8 parameter stays FP8 through ``model.to(torch.bfloat16)``); a device moves the
    FP8 bytes, the scale and the transposed copy."""
    if (dtype is not None and not dtype.is_floating_point) or layout not in (None, torch.strided):
        return NotImplemented

    def copy(u):
        return None if u is None else u.to(device=device or u.device, non_blocking=non_blocking,
                                           copy=True)
    return Float8Tensor(copy(t._data), copy(t._scale_inv), dtype or t.dtype, copy(t._transpose),
                        transpose_scale_inv=copy(t._transpose_scale_inv))


_HANDLERS = {
    aten.detach.default: _same(torch.Tensor.detach),
    aten.clone.default: _same(lambda t, **kw: t.clone(**kw), copy_scale=True),
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _reshape,
    aten.t.default: _t,
    aten.transpose.int: _transpose,
    aten.as_strided.default: _as_strided,
    aten.select.int: _subset(aten.select.int),
    aten.slice.Tensor: _subset(aten.slice.Tensor),
    aten.index.Tensor: _subset(aten.index.Tensor),
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten._to_copy.default: _to_copy,
}


# A field type for args that may carry either a tensor or a Float8Tensor; custom ops
# receive it as (data or tensor, scale_inv, transposed copy, original dtype).
Fp8Able = Union[torch.Tensor, Float8Tensor]
