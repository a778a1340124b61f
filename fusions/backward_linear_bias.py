"""BackwardLinearBias: the whole backward of a linear layer with bias in one stage."""

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import bias_grad, gemm_backward, split_dgrad, split_gemm_backward
from fusible.functional.linear_records import GemmBackwardArgs
from fusible.functional.linear_state import gemm_backward_args
from fusible.ops import BackwardResult, BasicLinear, Bias


class BackwardLinearBias(FusedOperation):
    """``dbias = dy.sum(tokens)``, ``dx = dy @ weight``, ``dweight = dy.T @ x`` as one stage.

    Pattern (forward order): ``BasicLinear, Bias``. Accepts when the bias needs a
    gradient (otherwise BasicLinear alone does the same work).
    Reads: BasicLinear's ``LinearSaved`` (FP8 copies under FP8); Bias saved nothing.
    FP8: takes ``dy`` in high precision, since dbias sums it before it is quantized
    for the GEMMs. One stage instead of two halves the per-stage overhead of a linear
    layer's backward; the kernels are those of the unfused ops.
    """

    direction = "backward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias"))
    bwd_args_type = GemmBackwardArgs  # BasicLinear's own: dbias is always wanted here
    handles_communication = True  # BasicLinear's collectives run in gemm_backward

    @classmethod
    def accepts(cls, match, env):
        if not env.needs[match.indices[1]].params[0]:
            return "the Bias needs no gradient: BasicLinear's own backward does the rest"
        return True

    def grad_format(self, recipe, needs):
        return None  # dbias reads dy in high precision; the GEMMs quantize it inside

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return gemm_backward_args(ctxs[0], grad_output, self.match["linear"].parallel,
                                  self.match["linear"].wgrad_dtype)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dx, dw = gemm_backward(args)
        return BackwardResult(dx, (dw, bias_grad(args.grad_output)))

    # A split backward: in high precision dbias goes with the wgrad, which keeps dy anyway;
    # under FP8 with the dgrad, which reads dy in high precision (the wgrad lane keeps only
    # its FP8 copy, what its GEMM reads).
    @classmethod
    def dgrad_compute(cls, args, *, in_custom_op=False):
        dgrad, wgrad = split_gemm_backward(args)
        dx = split_dgrad(dgrad, args.grad_output)
        dbias = None if args.grad_format is None else bias_grad(args.grad_output)
        return BackwardResult(dx, (None, dbias)), wgrad

    @classmethod
    def wgrad_compute(cls, args, *, in_custom_op=False):
        dbias = bias_grad(args.grad_output) if args.grad_format is None else None
        return BackwardResult(None, (gemm_backward(args)[1], dbias))

    def deferred_params(self, recipe, needs):
        verdict = self.match["linear"].deferred_params(recipe, needs[:1])
        return verdict if isinstance(verdict, str) else (True, recipe is None)

    @classmethod
    def example(cls):
        return Example((BasicLinear(32, 48), Bias(48)), (16, 32))
