"""BackwardLinearBias: the whole backward of a linear layer with bias in one stage."""

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.ops import BackwardResult, BasicLinear, Bias
from fusible.ops.basic_linear import LinearBackwardArgs, linear_backward, linear_backward_args
from fusible.ops.bias import bias_grad


@register_fusion
class BackwardLinearBias(FusedOperation):
    """``dbias = dy.sum(tokens)``, ``dx = dy @ weight``, ``dweight = dy.T @ x`` as one stage.

    Pattern (forward order): ``BasicLinear, Bias``. Accepts when the bias needs a
    gradient (otherwise BasicLinear alone does the same work).
    Reads: BasicLinear's saved ``(input, weight)`` (FP8 copies under FP8); Bias saved
    nothing. dbias comes from the gradient before it is quantized. One stage instead of
    two halves the per-stage overhead of a linear layer's backward; the kernels are those
    of the unfused ops.
    """

    direction = "backward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias"))
    bwd_args_type = LinearBackwardArgs  # BasicLinear's own: dbias is always wanted here
    handles_communication = True  # BasicLinear's collectives run in linear_backward

    @classmethod
    def accepts(cls, match, env):
        if not env.needs[match.indices[1]].params[0]:
            return "the Bias needs no gradient: BasicLinear's own backward does the rest"
        return True

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return linear_backward_args(ctxs[0], grad_output, self.match["linear"].tp)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dx, (dw,) = linear_backward(args)
        return BackwardResult(dx, (dw, bias_grad(args.grad_output)))
