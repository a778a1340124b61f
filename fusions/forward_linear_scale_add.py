"""ForwardLinearScaleAdd: a linear layer, a constant scale and the residual add in one
GEMM."""

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import GemmForwardArgs, gemm_forward, like_tokens, tokens_2d
from fusible.functional.linear_state import forward_aux, gemm_forward_args, save_linear
from fusible.ops import AddExtraInput, BasicLinear, ConstantScale, ForwardResult
from fusible.ops.basic_linear import parallel_refusal


@attrs.define
class LinearScaleAddForwardArgs:
    gemm: GemmForwardArgs  # never tensor-parallel: the fusion refuses it
    scale: float
    extra_input: torch.Tensor


class ForwardLinearScaleAdd(FusedOperation):
    """``y = residual + scale * x @ weight.T``: the GEMM reads the residual as its C
    matrix and the scale as its ``alpha`` (TransformerEngine's ForwardLinearScaleAdd).

    Pattern: ``BasicLinear, ConstantScale, AddExtraInput``. Accepts every match without
    tensor parallelism. Rounded once in high precision where the unfused ops round three
    times. Under an FP8 recipe: ``torch._scaled_mm``, then one kernel for
    ``residual + scale * y`` (``_scaled_mm`` cannot accumulate into C); takes its input in
    BasicLinear's format.
    Saves: BasicLinear's ``LinearSaved``; ConstantScale and AddExtraInput save nothing.
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(ConstantScale, name="scale"),
                      Op(AddExtraInput, name="add"))
    fwd_args_type = LinearScaleAddForwardArgs

    @classmethod
    def accepts(cls, match, env):
        return parallel_refusal(match["linear"])

    def input_format(self, recipe, needs):
        return self.match["linear"].input_format(recipe, needs[:1])

    def forward_args(self, input, params, extra_inputs, ctxs):
        gemm = gemm_forward_args(input, params[0], self.match["linear"].tp, ctxs[0])
        return LinearScaleAddForwardArgs(gemm, self.match["scale"].scale, extra_inputs[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        gemm = args.gemm
        if gemm.fp8:
            y, kept = gemm_forward(gemm)
            return ForwardResult(torch.add(args.extra_input, y, alpha=args.scale), (),
                                 forward_aux(gemm, kept))
        x = gemm.input
        y = torch.addmm(tokens_2d(args.extra_input), tokens_2d(x), gemm.weight.t(),
                        alpha=args.scale)
        return ForwardResult(like_tokens(y, x))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.gemm, result.aux)

    @classmethod
    def example(cls):
        return Example((BasicLinear(32, 32), ConstantScale(0.5), AddExtraInput()), (16, 32),
                       ((16, 32),))
