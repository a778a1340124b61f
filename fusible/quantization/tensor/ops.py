"""Float8Tensor's op table: what ``__torch_dispatch__`` does with each op. Views,
transposes, detach, clone, moves and indexing by a per-tensor scale stay in FP8; GEMMs
between Float8Tensors run as FP8 GEMMs; an op that writes into Float8Tensors runs on
their values and quantizes them again in place; anything else dequantizes."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fusible.quantization.casts.common import scale_blocks
from fusible.quantization.casts.tensorwise import cast_tensorwise
from fusible.quantization.gemm import scaled_gemm
from fusible.quantization.scalings.base import scaling_of
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.tensor.quantize import per_column_scales, quantize_scaled

aten = torch.ops.aten


def dispatch(func, args: tuple, kwargs: dict):
    """``Float8Tensor.__torch_dispatch__``: ``func`` by its handler (:data:`HANDLERS`),
    else as an in-place write into Float8Tensors, else on the dequantized values."""
    handler = HANDLERS.get(func)
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
        parts = cast_tensorwise(values.contiguous(), t.fp8_dtype, t._transpose is not None)
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
        return per_column_scales(scale_inv, shape)
    return None


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
    blocks_a = scale_blocks(a_side[1].shape, a_side[0].shape)
    blocks_b = scale_blocks(b_side[1].shape, b_side[0].shape)
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


HANDLERS = {
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
