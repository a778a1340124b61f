"""BackwardLinearAdd: dgrad GEMM accumulating into the branch's gradient."""

from typing import Optional

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.ops import BackwardResult, BasicLinear, MakeExtraOutput
from fusible.ops.basic_linear import linear_dgrad, linear_wgrad


@attrs.define
class LinearAddBackwardArgs:
    grad_output: torch.Tensor
    grad_extra_output: Optional[torch.Tensor]
    input: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    need_grad_weight: bool


@register_fusion
class BackwardLinearAdd(FusedOperation):
    """``dx = d_branch + dy @ weight`` in one GEMM (the branch gradient as its C matrix).

    Pattern (forward order): ``MakeExtraOutput, BasicLinear``; in the backward the
    linear's dgrad is accumulated into the gradient of the extra output.
    Accepts when the input needs a gradient (otherwise there is no dgrad).
    Reads: BasicLinear's saved ``(input, weight)``; computes its wgrad too.
    """

    direction = "backward"
    pattern = Pattern(Op(MakeExtraOutput, name="branch"), Op(BasicLinear, name="linear"))
    bwd_args_type = LinearAddBackwardArgs

    @classmethod
    def accepts(cls, match, env):
        if not env.needs[match.indices[0]].input:
            return "MakeExtraOutput's input needs no gradient: there is no dgrad to accumulate"
        return True

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        x, weight = ctxs[1].saved
        return LinearAddBackwardArgs(grad_output, grad_extra_outputs[0], x, weight,
                                     ctxs[1].needs.params[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dx = linear_dgrad(args.grad_output, args.weight, accumulate_into=args.grad_extra_output)
        dw = linear_wgrad(args.grad_output, args.input) if args.need_grad_weight else None
        return BackwardResult(dx, (dw,))
