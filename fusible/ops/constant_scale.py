"""ConstantScale: ``y = scale * x``."""

from __future__ import annotations

import attrs
import torch

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class ScaleForwardArgs:
    input: Tensor
    scale: float


@attrs.define
class ScaleBackwardArgs:
    grad_output: Tensor
    scale: float
    need_grad_input: bool


class ConstantScale(BasicOperation):
    """Multiply by a constant Python float. Saves nothing; ``dx = scale * dy``."""

    keeps_features = True

    fwd_args_type = ScaleForwardArgs
    bwd_args_type = ScaleBackwardArgs

    attribute_checks = {"scale": checks.real("scale")}

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def describe(self) -> str:
        return f"ConstantScale(scale={self.scale})"

    def forward_args(self, input, params, extra_inputs, ctxs):
        return ScaleForwardArgs(input, self.scale)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input * args.scale)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return ScaleBackwardArgs(grad_output, self.scale, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.grad_output * args.scale if args.need_grad_input else None)

    def reference(self, x, extra_inputs, params):
        return x * self.scale, ()

    @classmethod
    def example(cls):
        return Example((cls(-0.75),), (5, 16))

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
