"""BackwardLinearScale: a constant scale after a linear layer folded into its backward
GEMMs."""

import attrs

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import gemm_backward, split_dgrad, split_gemm_backward
from fusible.functional.linear_records import GemmBackwardArgs
from fusible.functional.linear_state import gemm_backward_args
from fusible.ops import BackwardResult, BasicLinear, ConstantScale


@attrs.define
class LinearScaleBackwardArgs:
    gemm: GemmBackwardArgs
    scale: float


class BackwardLinearScale(FusedOperation):
    """``dx = scale * dy @ weight``, ``dweight = scale * dy.T @ x``: no pass over ``dy``
    for the scale, and each gradient rounded once.

    Pattern (forward order): ``BasicLinear, ConstantScale``. Accepts every match (the scale
    is linear: it commutes with the layer's collectives, which ``gemm_backward`` runs).
    Reads: BasicLinear's ``LinearSaved``; ConstantScale saved nothing. In high precision
    the scale is the GEMMs' ``alpha``; under FP8 ``dy`` arrives in BasicLinear's format,
    unscaled, and the scale multiplies its inverse scale (the GEMMs' epilogue again).
    """

    direction = "backward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(ConstantScale, name="scale"))
    bwd_args_type = LinearScaleBackwardArgs
    handles_communication = True  # BasicLinear's collectives run in gemm_backward

    @classmethod
    def accepts(cls, match, env):
        return True

    def grad_format(self, recipe, needs):
        return self.match["linear"].grad_format(recipe, needs[:1])

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        gemm = gemm_backward_args(ctxs[0], grad_output, self.match["linear"].parallel,
                                  self.match["linear"].wgrad_dtype)
        return LinearScaleBackwardArgs(gemm, self.match["scale"].scale)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dx, dw = gemm_backward(args.gemm, grad_scale=args.scale)
        return BackwardResult(dx, (dw,))

    @classmethod
    def dgrad_compute(cls, args, *, in_custom_op=False):
        dgrad, wgrad = split_gemm_backward(args.gemm)
        dx = split_dgrad(dgrad, args.gemm.grad_output, grad_scale=args.scale)
        return BackwardResult(dx, (None,)), LinearScaleBackwardArgs(wgrad, args.scale)

    @classmethod
    def wgrad_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(None, (gemm_backward(args.gemm, grad_scale=args.scale)[1],))

    def deferred_params(self, recipe, needs):
        return self.match["linear"].deferred_params(recipe, needs[:1])

    @classmethod
    def example(cls):
        return Example((BasicLinear(32, 48), ConstantScale(-0.75)), (16, 32))
