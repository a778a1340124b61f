"""MakeExtraOutput: branch the stage input off as an extra output of the pipeline.

A pipeline with MakeExtraOutput ops returns ``(y, *extra_outputs)``.
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
class BranchForwardArgs:
    input: Tensor


@attrs.define
class BranchBackwardArgs:
    grad_output: Tensor
    grad_extra_output: Optional[Tensor]
    need_grad_input: bool


class MakeExtraOutput(ExtraTensorOptions, BasicOperation):
    """Passes its input on and also returns it as an extra output. Saves nothing.

    In the backward, the gradient of the extra output is added to the gradient
    flowing through.

    Parameters
    ----------
    in_place : bool
        Accepted for TransformerEngine's option, which adds the gradient flowing through
        into the extra output's incoming gradient buffer. Here the sum is computed out of
        place all the same (same values, one buffer more): autograd may hand one gradient
        tensor to several consumers (both operands of an addition, a caller's tensor), and
        a write into it would corrupt their gradients silently.
    channel : str, optional
        Hand the tensor to the ``AddExtraInput(channel=...)`` ops of that name after it in
        the same Sequential rather than to the caller (who no longer receives it); their
        gradients come back here.
    """

    keeps_features = True
    attribute_checks = {"in_place": checks.boolean("in_place"),
                        "channel": checks.optional(checks.name_string("channel"))}

    def __init__(self, *, in_place: bool = False, channel: Optional[str] = None):
        super().__init__()
        self.in_place, self.channel = in_place, channel

    num_extra_outputs = 1
    fwd_args_type = BranchForwardArgs
    bwd_args_type = BranchBackwardArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return BranchForwardArgs(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input, (args.input,))

    def save_for_backward(self, args, result, ctxs):
        pass

    def inline_when_compiled(self, direction):
        return direction == "forward"  # x handed on twice: no copy when compiled

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return BranchBackwardArgs(grad_output, grad_extra_outputs[0], ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        if args.grad_extra_output is None:
            return BackwardResult(args.grad_output)
        return BackwardResult(args.grad_output + args.grad_extra_output)

    def reference(self, x, extra_inputs, params):
        return x, (x,)

    @classmethod
    def example(cls):
        return Example((cls(),), (4, 16))

