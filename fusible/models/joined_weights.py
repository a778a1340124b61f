"""Weights a fused layer takes joined (Llama's q/k/v and gate/up projections) that stay
the model's own separate parameters: :func:`colocate` moves them once, at conversion,
into one buffer end to end (the parameter objects stay: an optimizer built before keeps
training them, and their state-dict entries are the same), and each call's :func:`joined`
is then a view of that buffer, with no copy forward and a split of the gradient (views)
backward. Where they do not lie end to end (moved or cast after the conversion, sharded,
on the meta device) and while dynamo traces (which cannot read addresses), the join is
``torch.cat``: the same values, a copy per call (at Llama-3-8B widths 285 MB a layer;
compiled, made again in the backward rather than kept for it: a copy more, and no copy of
every layer's weights on the peak). So is a join of fewer than ``VIEW_FROM_BYTES`` (small
models' layers), eager or compiled, and kept for the backward: the view's autograd node
runs in Python, tens of microseconds of host time a call forward and backward, more than
a copy of a few MiB costs the device; compiled, a recomputed copy would be one more
kernel to compile and launch for a few MiB saved.

Each parameter's in-place changes between the forward and the backward are caught, as
for a copy. A parameter saved alone (``torch.save(layer.k_proj.weight)``) saves its whole
buffer, as any view does."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Joins of fewer bytes than this are copies (torch.cat) even where a view could be made
VIEW_FROM_BYTES = 8 * 2 ** 20


def colocate(modules: Sequence[nn.Module]) -> None:
    """Move the weights (and the biases, where all have one) of ``modules`` end to end
    into one new buffer each, keeping the parameter objects; nothing for parameters that
    are not plain dense tensors of one dtype, device and row width."""
    for name in ("weight", "bias"):
        found = [getattr(m, name, None) for m in modules]
        if not _movable(found):
            continue
        tensors: list[nn.Parameter] = found  # type: ignore[assignment]
        with torch.no_grad():
            buffer = torch.cat([t.detach() for t in tensors])
            offset = 0
            for t in tensors:
                rows = t.shape[0]
                t.data = buffer[offset:offset + rows]
                offset += rows


def _movable(tensors: list) -> bool:
    if len(tensors) < 2 or not all(type(t) is nn.Parameter for t in tensors):
        return False
    first = tensors[0]
    return first.device.type != "meta" and all(
        t.dtype == first.dtype and t.device == first.device and t.shape[1:] == first.shape[1:]
        and t.layout == torch.strided for t in tensors)


def joined(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.cat(tensors)`` (along the rows): a view where they lie end to end in one
    buffer and hold ``VIEW_FROM_BYTES`` or more, a copy otherwise."""
    if _bytes(tensors) >= VIEW_FROM_BYTES:
        if torch.compiler.is_compiling():  # recomputed in the backward, not saved for it
            return checkpoint(_cat, *tensors, use_reentrant=False)
        if not torch._C._are_functorch_transforms_active() and end_to_end(tensors):
            return _JoinedView.apply(*tensors)  # (functorch's wrappers have no storage)
    return torch.cat(list(tensors))


def _cat(*tensors: Tensor) -> Tensor:
    return torch.cat(tensors)


def _bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() for t in tensors) * tensors[0].element_size()


def end_to_end(tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` are contiguous rows of one storage, each right after the one
    before."""
    first = tensors[0]
    if len(tensors) < 2 or first.device.type == "meta" or not first.is_contiguous():
        return False
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for before, t in zip(tensors, tensors[1:]):
        offset += before.numel()
        if not (t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
                and t.shape[1:] == first.shape[1:] and t.storage_offset() == offset
                and t.untyped_storage().data_ptr() == storage):
            return False
    return True


class _JoinedView(torch.autograd.Function):
    """The rows of tensors lying end to end as one tensor (a view of their storage);
    backward: the gradient's rows split back (views)."""

    @staticmethod
    def forward(ctx, *tensors: Tensor) -> Tensor:
        ctx.rows = [t.shape[0] for t in tensors]
        ctx.save_for_backward(*tensors)  # their versions checked: the view shares the first's
        first = tensors[0].detach()
        return first.as_strided((sum(ctx.rows), *first.shape[1:]), first.stride(),
                                first.storage_offset())

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.saved_tensors  # noqa: B018 - raises if one was changed in place since
        return tuple(grad.split(ctx.rows))
