"""A weight that FSDP2 all-gathers in FP8: ``Float8AllGatherWeight``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) lets the local tensor of a sharded parameter
decide what is all-gathered, through two methods it calls by name
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``). This wrapper holds the
high-precision shard (what the optimizer updates and checkpoints save); before each
all-gather it casts the shard to FP8 with one scale for the whole weight (the absolute
maxima all-reduced over the shard group: the scale a cast of the gathered weight would
compute), so that half the bytes of bf16 cross; after it, the gathered bytes become a
:class:`~fusible.quantization.tensor.float8_tensor.Float8Tensor` with its transposed copy (for
dgrad), which the linear layers' FP8 GEMMs read as they read an FP8 parameter: no second
cast. Bit for bit the weight that gathering in high precision and quantizing would give.

FSDP2 keeps the buffers of the first all-gather and gathers into them again (in the
backward, after resharding): so every gather of a wrapped weight is in FP8, inside or
outside ``fusible.autocast`` (outside, the layers dequantize it for each use).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fusible.kernels.fp8_cast import transposed_copy
from fusible.quantization.casts.tensorwise import cast_tensorwise, tensor_amax
from fusible.quantization.tensor.float8_tensor import Float8Tensor

aten = torch.ops.aten

# The ops that keep the wrapper (FSDP's sharding and padding, moves, copies, views);
# any other op runs on the high-precision tensor and returns a plain result.
_KEEPS_WRAPPER = {aten.detach.default, aten.alias.default, aten.clone.default,
                  aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default,
                  aten.zeros_like.default, aten.slice.Tensor, aten.split.Tensor,
                  aten.split_with_sizes.default, aten.chunk.default, aten.narrow.default,
                  aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                  aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
                  aten.copy_.default, aten.t.default, aten.flatten.using_ints}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers in FP8.

    Made by :func:`fusible.fsdp_float8_all_gather`; everything but FSDP2's all-gather sees
    the high-precision values (``.hp``): optimizer steps, state dicts, ``copy_``.
    """

    _tensor: torch.Tensor
    _fp8_dtype: torch.dtype

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
        self = torch.Tensor._make_wrapper_subclass(
            cls, tensor.shape, strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, requires_grad=tensor.requires_grad)
        self._tensor, self._fp8_dtype = tensor, fp8_dtype
        return self

    @property
    def hp(self) -> torch.Tensor:
        """The high-precision values."""
        return self._tensor

    def __repr__(self) -> str:  # type: ignore[override]  # mypy bug: kw-only dunder args
        return f"Float8AllGatherWeight({self._fp8_dtype}, {self._tensor!r})"

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, DCP checkpoints) as the plain high-precision tensor: files
        # that load anywhere, with weights_only too, and into an unwrapped model.
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_tensor"], self._fp8_dtype

    @staticmethod
    def __tensor_unflatten__(inner, fp8_dtype, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_tensor"], fp8_dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fp8_dtype = next(a._fp8_dtype for a in pytree.tree_leaves((args, kwargs))
                         if isinstance(a, Float8AllGatherWeight))
        args, kwargs = pytree.tree_map_only(Float8AllGatherWeight, lambda t: t._tensor,
                                            (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEPS_WRAPPER:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: Float8AllGatherWeight(t, fp8_dtype),
                                    out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This shard in FP8 (as bytes: any backend gathers them), scaled for the whole
        weight; FSDP2 calls it before every all-gather of the weight."""
        shard = self._tensor
        if mp_policy.param_dtype is not None:  # the weight the GEMMs would quantize
            shard = shard.to(mp_policy.param_dtype)
        amax = tensor_amax(shard)
        if mesh.size() > 1:
            dist.all_reduce(amax, dist.ReduceOp.MAX, group=mesh.get_group())
        data, scale_inv = cast_tensorwise(shard, self._fp8_dtype, False, amax)[:2]
        rows = -(-outer_size[0] // mesh.size())  # FSDP pads every shard to this many
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data.view(torch.uint8),), (scale_inv, tuple(outer_size))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered bytes as a Float8Tensor of the full weight with its transposed
        copy; with ``out`` (a later gather into the first one's buffers), refreshed in
        place."""
        (gathered,), (scale_inv, size) = outputs, metadata
        data = gathered.view(self._fp8_dtype)[:size[0]]  # the padding dropped: a view
        if out is not None:  # the tensors the forward saved for the backward: refilled as
            # FSDP2 refills the gathered bytes, not counted as an in-place change
            with torch.autograd._unsafe_preserve_version_counter(out._scale_inv):
                out._scale_inv.copy_(scale_inv)
            with torch.autograd._unsafe_preserve_version_counter(out._transpose):
                transposed_copy(data, out=out._transpose)
            return None
        transpose = transposed_copy(data)
        weight = Float8Tensor(data, scale_inv.clone(), param_dtype, transpose)
        return weight, (gathered, transpose)
