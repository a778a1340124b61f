"""A basic operation written outside the library: ``y = scale * x**3``.

It declares its arguments and its saved state as attrs records and computes in two
classmethods; fusible derives its custom ops from those records, so it runs eagerly
and under ``torch.compile(fullgraph=True)`` alike:

    python examples/custom_operation.py
"""

from typing import Optional

import attrs
import torch

import fusible
from fusible import ops
from fusible.ops import BackwardResult, BasicOperation, ForwardResult


@attrs.define
class CubeArgs:
    input: torch.Tensor
    scale: float


@attrs.define
class CubeSaved:
    input: Optional[torch.Tensor]


@attrs.define
class CubeBackwardArgs:
    grad_output: torch.Tensor
    input: Optional[torch.Tensor]
    scale: float
    need_grad_input: bool


class ScaledCube(BasicOperation):
    """``y = scale * x**3``. Saves its input when the input needs a gradient."""

    fwd_args_type = CubeArgs
    bwd_args_type = CubeBackwardArgs
    saved_type = CubeSaved

    def __init__(self, scale: float):
        super().__init__()
        self.scale = float(scale)

    def describe(self) -> str:
        return f"ScaledCube(scale={self.scale})"

    def forward_args(self, input, params, extra_inputs, ctxs):
        return CubeArgs(input, self.scale)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.scale * args.input ** 3)

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = CubeSaved(args.input if ctxs[0].needs.input else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return CubeBackwardArgs(grad_output, ctxs[0].saved.input, self.scale,
                                ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(args.grad_output * (3 * args.scale) * args.input ** 2)

    def reference(self, x, extra_inputs, params):
        """The FP64 reference the test helpers compare with."""
        return self.scale * x ** 3, ()


if __name__ == "__main__":
    model = ops.Sequential(ops.Linear(16, 32), ScaledCube(0.5), ops.Linear(32, 16))
    x = torch.randn(8, 16, requires_grad=True)
    print(fusible.compile_report(model, x))
    compiled = torch.compile(model, fullgraph=True)
    print("compiled == eager:", torch.equal(compiled(x), model(x)))
