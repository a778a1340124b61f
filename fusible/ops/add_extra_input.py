"""AddExtraInput: a residual add of one of the pipeline's extra inputs.

``model(x, *extra_inputs)`` hands the extra inputs, in order, to the AddExtraInput ops.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation
from fusible.ops.extra_tensor_options import ExtraTensorOptions

Tensor = torch.Tensor


@attrs.define
class AddForwardArgs:
    input: Tensor
    extra_input: Tensor
    in_place: bool = False


@attrs.define
class AddBackwardArgs:
    grad_output: Tensor
    need_grad_input: bool
    need_grad_extra_input: bool


class AddExtraInput(ExtraTensorOptions, BasicOperation):
    """``y = x + extra``, the extra input taken from the pipeline's extra inputs.

    The extra input must have the shape, dtype and device of ``x``. Saves nothing.

    Parameters
    ----------
    in_place : bool
        Write the sum into the extra input, which becomes the output (TransformerEngine's
        option: no buffer for the output; a fused linear layer before it accumulates its
        GEMM into the extra input). As with any in-place op, the caller's tensor changes
        and autograd refuses the backward of anything that saved it; the extra input
        must be contiguous, and the op the last of its Sequential (its output is the
        extra input itself). Compiled, the add runs in the graph (a custom op may not
        write into its inputs).
    channel : str, optional
        Take the extra input from the ``MakeExtraOutput(channel=...)`` of that name
        before it in the same Sequential rather than from the caller (an internal
        residual; several readers may share a channel, their gradients summed). Not
        with ``in_place``.
    """

    keeps_features = True
    attribute_checks = {"in_place": checks.boolean("in_place"),
                        "channel": checks.optional(checks.name_string("channel"))}

    num_extra_inputs = 1
    fwd_args_type = AddForwardArgs
    bwd_args_type = AddBackwardArgs

    def __init__(self, *, in_place: bool = False, channel: Optional[str] = None):
        super().__init__()
        self.in_place, self.channel = in_place, channel
        if in_place and channel is not None:
            raise ValueError(f"{self.describe()}: in_place writes into the caller's tensor; a "
                             f"channel's is an intermediate of the pipeline")

    def validate(self, shape, dtype, device, extra_inputs=()):
        (extra,) = extra_inputs
        if not isinstance(extra, torch.Tensor):
            raise TypeError(f"AddExtraInput needs a tensor extra input, got "
                            f"{type(extra).__name__}")
        if tuple(extra.shape) != tuple(shape):
            raise ValueError(f"AddExtraInput got extra input of shape {tuple(extra.shape)} for "
                             f"an input of shape {tuple(shape)}; they must match")
        if extra.dtype != dtype or extra.device != device:
            raise TypeError(f"AddExtraInput got extra input of dtype {extra.dtype} on "
                            f"{extra.device} for an input of dtype {dtype} on {device}")
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return AddForwardArgs(input, extra_inputs[0], self.in_place)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        if args.in_place:  # never a custom op (inline_when_compiled)
            return ForwardResult(args.extra_input.add_(args.input))
        return ForwardResult(args.input + args.extra_input)

    def save_for_backward(self, args, result, ctxs):
        pass

    def inline_when_compiled(self, direction):
        # backward: dy handed on as it is, no copy when compiled; forward in place: a
        # custom op may not write into its inputs
        return direction == "backward" or self.in_place

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs = ctxs[0].needs
        return AddBackwardArgs(grad_output, needs.input, needs.extra_inputs[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dy = args.grad_output
        return BackwardResult(dy if args.need_grad_input else None, (),
                              (dy if args.need_grad_extra_input else None,))

    def reference(self, x, extra_inputs, params):
        return x + extra_inputs[0], ()

    @classmethod
    def example(cls):
        return Example((cls(),), (2, 3, 16), ((2, 3, 16),))
