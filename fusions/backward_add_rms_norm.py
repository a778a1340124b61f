"""BackwardAddRMSNorm: the residual branch's gradient added inside RMSNorm's backward."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.norms import effective_gamma, rms_norm_backward
from fusible.ops import BackwardResult, MakeExtraOutput, RMSNorm
from fusible.ops.rms_norm import RMSNormBackwardArgs


@attrs.define
class AddRMSNormBackwardArgs:
    norm: RMSNormBackwardArgs
    grad_extra_output: Optional[torch.Tensor]


class BackwardAddRMSNorm(FusedOperation):
    """``dx = d_branch + RMSNorm's dx`` in the norm's backward kernel (float32, one
    rounding), where the unfused ops write RMSNorm's ``dx`` and add the branch's gradient
    in a second pass (TransformerEngine's BackwardAddRMSNorm).

    Pattern (forward order): ``MakeExtraOutput, RMSNorm``: a pre-norm block's residual
    branch. Accepts when the input needs a gradient. Reads RMSNorm's ``RMSNormSaved``;
    MakeExtraOutput saved nothing. Under an FP8 recipe ``dx`` stays in high precision
    (the caller quantizes it where the previous stage wants FP8), as RMSNorm's does.
    """

    direction = "backward"
    pattern = Pattern(Op(MakeExtraOutput, name="branch"), Op(RMSNorm, name="norm"))
    bwd_args_type = AddRMSNormBackwardArgs

    @classmethod
    def accepts(cls, match, env):
        if not env.needs[match.indices[0]].input:
            return "MakeExtraOutput's input needs no gradient: there is nothing to add into"
        return True

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        norm = self.match["norm"].backward_args(grad_output, (), ctxs[1:])
        return AddRMSNormBackwardArgs(norm, grad_extra_outputs[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        norm = args.norm
        dx, dw = rms_norm_backward(norm.grad_output, norm.input, norm.rstd,
                                   effective_gamma(norm.weight, norm.zero_centered_gamma),
                                   norm.normalized_shape, norm.need_grad_input,
                                   norm.need_grad_weight, accumulate_into=args.grad_extra_output)
        return BackwardResult(dx, (None if dw is None else dw.to(norm.weight.dtype),))

    @classmethod
    def example(cls):
        return Example((MakeExtraOutput(), RMSNorm(32)), (3, 5, 32))
