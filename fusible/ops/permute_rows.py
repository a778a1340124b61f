"""PermuteRows: the input's rows reordered by a permutation given at call time."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.moe_rows import inverse_permutation
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class PermuteRowsForwardArgs:
    input: Tensor
    index: Tensor


@attrs.define
class PermuteRowsSaved:
    index: Tensor


@attrs.define
class PermuteRowsBackwardArgs:
    grad_output: Tensor
    index: Optional[Tensor]
    need_grad_input: bool


class PermuteRows(BasicOperation):
    """``y = x[index]`` along dim 0, ``index`` a permutation of the rows: ``model(x,
    index)`` (an integer tensor on ``x``'s device, an extra input). Backward: a gather by
    the inverse permutation (no scatter, no atomics). In an expert-parallel layer it
    groups the rows an all-to-all received by local expert, and back
    (:func:`fusible.moe.expert_parallel`)."""

    num_extra_inputs = 1
    keeps_features = True
    fwd_args_type = PermuteRowsForwardArgs
    bwd_args_type = PermuteRowsBackwardArgs
    saved_type = PermuteRowsSaved

    def describe(self) -> str:
        return "PermuteRows()"

    def validate(self, shape, dtype, device, extra_inputs=()):
        (index,) = extra_inputs
        rows = shape[0] if shape and shape[0] >= 0 else None  # unknown after an AllToAll
        if not (isinstance(index, torch.Tensor) and index.dim() == 1
                and not index.is_floating_point() and rows in (None, index.shape[0])):
            got = (f"{index.dtype} of shape {tuple(index.shape)}"
                   if isinstance(index, torch.Tensor) else type(index).__name__)
            want = f"shape ({rows},)" if rows is not None else "one dimension"
            raise TypeError(f"PermuteRows takes a permutation of the input's rows as an "
                            f"integer tensor of {want}, got {got}")
        if index.device != device:
            raise ValueError(f"PermuteRows: the index is on {index.device}, the input on "
                             f"{device}")
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return PermuteRowsForwardArgs(input, extra_inputs[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        if args.index.shape[0] != args.input.shape[0]:  # rows unknown when planned
            raise ValueError(f"PermuteRows: the index has {args.index.shape[0]} entries for "
                             f"{args.input.shape[0]} rows")
        return ForwardResult(args.input.index_select(0, args.index))

    def save_for_backward(self, args, result, ctxs):
        if ctxs[0].needs.input:
            ctxs[0].saved = PermuteRowsSaved(args.index)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return PermuteRowsBackwardArgs(grad_output, ctxs[0].saved.index if ctxs[0].needs.input
                                       else None, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None, (), (None,))
        inverse = inverse_permutation(args.index)
        return BackwardResult(args.grad_output.index_select(0, inverse), (), (None,))

    def reference(self, x, extra_inputs, params):
        return x[extra_inputs[0].to(x.device)], ()

    @classmethod
    def example(cls):
        return Example((cls(),), (5, 16), extra_input_values=(torch.tensor([3, 0, 4, 1, 2]),),
                       fp8=False)
