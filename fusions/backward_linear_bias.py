"""BackwardLinearBias: the whole backward of a linear layer with bias in one stage."""

from typing import Optional

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.ops import BackwardResult, BasicLinear, Bias
from fusible.ops.basic_linear import linear_backward
from fusible.ops.bias import bias_grad


@attrs.define
class LinearBiasBackwardArgs:
    grad_output: torch.Tensor
    input: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    need_grad_input: bool
    need_grad_weight: bool
    need_grad_bias: bool


@register_fusion
class BackwardLinearBias(FusedOperation):
    """``dbias = dy.sum(tokens)``, ``dx = dy @ weight``, ``dweight = dy.T @ x`` as one stage.

    Pattern (forward order): ``BasicLinear, Bias``. Accepts when the bias needs a
    gradient (otherwise BasicLinear alone does the same work).
    Reads: BasicLinear's saved ``(input, weight)``; Bias saved nothing.
    One stage instead of two halves the per-stage overhead of a linear layer's
    backward; the three kernels are those of the unfused ops.
    """

    direction = "backward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias"))
    bwd_args_type = LinearBiasBackwardArgs

    @classmethod
    def accepts(cls, match, env):
        if not env.needs[match.indices[1]].params[0]:
            return "the Bias needs no gradient: BasicLinear's own backward does the rest"
        return True

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        linear = ctxs[0]
        return LinearBiasBackwardArgs(grad_output, *linear.saved, linear.needs.input,
                                      linear.needs.params[0], True)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dx, (dw,) = linear_backward(args)
        return BackwardResult(dx, (dw, bias_grad(args.grad_output)))
