"""BackwardLinearAdd: dgrad GEMM accumulating into the branch's gradient."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import gemm_backward, split_dgrad, split_gemm_backward
from fusible.functional.linear_records import GemmBackwardArgs
from fusible.functional.linear_state import gemm_backward_args
from fusible.ops import BackwardResult, BasicLinear, MakeExtraOutput
from fusible.ops.basic_linear import parallel_refusal


@attrs.define
class LinearAddBackwardArgs:
    gemm: GemmBackwardArgs
    grad_extra_output: Optional[torch.Tensor]


class BackwardLinearAdd(FusedOperation):
    """``dx = d_branch + dy @ weight`` in one GEMM (the branch gradient as its C matrix).

    Pattern (forward order): ``MakeExtraOutput, BasicLinear``; in the backward the
    linear's dgrad is accumulated into the gradient of the extra output.
    Accepts when the input needs a gradient (otherwise there is no dgrad).
    Reads: BasicLinear's ``LinearSaved``; computes its wgrad too. Under an FP8 recipe the
    dgrad is an FP8 GEMM followed by the add, and ``dy`` arrives in BasicLinear's format.
    """

    direction = "backward"
    pattern = Pattern(Op(MakeExtraOutput, name="branch"), Op(BasicLinear, name="linear"))
    bwd_args_type = LinearAddBackwardArgs
    handles_communication = True  # row layers: gemm_backward gathers (accepts refuses column)

    @classmethod
    def accepts(cls, match, env):
        if not env.needs[match.indices[0]].input:
            return "MakeExtraOutput's input needs no gradient: there is no dgrad to accumulate"
        return parallel_refusal(match["linear"], (None, "row"))

    def grad_format(self, recipe, needs):
        return self.match["linear"].grad_format(recipe, needs[1:])

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        gemm = gemm_backward_args(ctxs[1], grad_output, self.match["linear"].parallel,
                                  self.match["linear"].wgrad_dtype)
        return LinearAddBackwardArgs(gemm, grad_extra_outputs[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dx, dw = gemm_backward(args.gemm, accumulate_into=args.grad_extra_output)
        return BackwardResult(dx, (dw,))

    @classmethod
    def dgrad_compute(cls, args, *, in_custom_op=False):
        dgrad, wgrad = split_gemm_backward(args.gemm)
        dx = split_dgrad(dgrad, args.gemm.grad_output, accumulate_into=args.grad_extra_output)
        return BackwardResult(dx, (None,)), LinearAddBackwardArgs(wgrad, None)

    @classmethod
    def wgrad_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(None, (gemm_backward(args.gemm)[1],))

    def deferred_params(self, recipe, needs):
        return self.match["linear"].deferred_params(recipe, needs[1:])

    @classmethod
    def example(cls):
        return Example((MakeExtraOutput(), BasicLinear(32, 32)), (16, 32))
