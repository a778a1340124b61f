"""Identity: ``y = x``."""

from __future__ import annotations

import attrs
import torch

from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class IdentityForwardArgs:
    input: Tensor


@attrs.define
class IdentityBackwardArgs:
    grad_output: Tensor
    need_grad_input: bool


class Identity(BasicOperation):
    """Returns its input unchanged. Saves nothing."""

    keeps_features = True

    fwd_args_type = IdentityForwardArgs
    bwd_args_type = IdentityBackwardArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return IdentityForwardArgs(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input)

    def save_for_backward(self, args, result, ctxs):
        pass

    def inline_when_compiled(self, direction):
        return True  # x and dy handed on: no copy when compiled

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return IdentityBackwardArgs(grad_output, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.grad_output if args.need_grad_input else None)

    def reference(self, x, extra_inputs, params):
        return x, ()

    @classmethod
    def example(cls):
        return Example((cls(),), (4, 16))
