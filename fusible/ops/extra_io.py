"""AddExtraInput and MakeExtraOutput: residual connections in a pipeline.

``model(x, *extra_inputs)`` hands the extra inputs, in order, to the
AddExtraInput ops; MakeExtraOutput ops branch extra outputs, returned as
``(y, *extra_outputs)``.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult, pass_through

Tensor = torch.Tensor


@attrs.define
class AddForwardArgs:
    input: Tensor
    extra_input: Tensor


@attrs.define
class AddBackwardArgs:
    grad_output: Tensor
    need_grad_input: bool
    need_grad_extra_input: bool


class AddExtraInput(BasicOperation):
    """``y = x + extra``, the extra input taken from the pipeline's extra inputs.

    The extra input must have the shape, dtype and device of ``x``. Saves nothing.
    """

    num_extra_inputs = 1
    fwd_args_type = AddForwardArgs
    bwd_args_type = AddBackwardArgs

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
        return AddForwardArgs(input, extra_inputs[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input + args.extra_input)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs = ctxs[0].needs
        return AddBackwardArgs(grad_output, needs.input, needs.extra_inputs[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dy = args.grad_output
        return BackwardResult(pass_through(dy, args.need_grad_input, in_custom_op), (),
                              (pass_through(dy, args.need_grad_extra_input, in_custom_op),))


@attrs.define
class BranchForwardArgs:
    input: Tensor


@attrs.define
class BranchBackwardArgs:
    grad_output: Tensor
    grad_extra_output: Optional[Tensor]
    need_grad_input: bool


class MakeExtraOutput(BasicOperation):
    """Passes its input on and also returns it as an extra output. Saves nothing.

    In the backward, the gradient of the extra output is added to the gradient
    flowing through.
    """

    num_extra_outputs = 1
    fwd_args_type = BranchForwardArgs
    bwd_args_type = BranchBackwardArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return BranchForwardArgs(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x = args.input
        return ForwardResult(pass_through(x, True, in_custom_op),
                             (pass_through(x, True, in_custom_op),))

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return BranchBackwardArgs(grad_output, grad_extra_outputs[0], ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        if args.grad_extra_output is None:
            return BackwardResult(pass_through(args.grad_output, True, in_custom_op))
        return BackwardResult(args.grad_output + args.grad_extra_output)
