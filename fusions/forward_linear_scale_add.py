"""ForwardLinearScaleAdd: a linear layer, a constant scale and the residual add in one
GEMM."""

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import gemm_forward, like_tokens, tokens_2d
from fusible.functional.linear_records import GemmForwardArgs
from fusible.functional.linear_state import forward_aux, gemm_forward_args, save_linear
from fusible.ops import AddExtraInput, BasicLinear, ConstantScale, ForwardResult
from fusible.ops.basic_linear import parallel_refusal


@attrs.define
class LinearScaleAddForwardArgs:
    gemm: GemmForwardArgs  # never tensor-parallel: the fusion refuses it
    scale: float
    extra_input: torch.Tensor
    in_place: bool = False  # AddExtraInput(in_place=True): the GEMM accumulates into it


class ForwardLinearScaleAdd(FusedOperation):
    """``y = residual + scale * x @ weight.T``: the GEMM reads the residual as its C
    matrix and the scale as its ``alpha`` (TransformerEngine's ForwardLinearScaleAdd).

    Pattern: ``BasicLinear, ConstantScale, AddExtraInput``. Accepts every match without
    tensor parallelism. Rounded once in high precision where the unfused ops round three
    times. Under an FP8 recipe: ``torch._scaled_mm``, then one kernel for
    ``residual + scale * y`` (``_scaled_mm`` cannot accumulate into C); takes its input in
    BasicLinear's format.
    Saves: BasicLinear's ``LinearSaved``; ConstantScale and AddExtraInput save nothing.
    With ``AddExtraInput(in_place=True)`` the GEMM accumulates into the residual itself,
    the output (run inline when compiled: a custom op may not write into its inputs).
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
        gemm = gemm_forward_args(input, params[0], self.match["linear"].parallel, ctxs[0])
        return LinearScaleAddForwardArgs(gemm, self.match["scale"].scale, extra_inputs[0],
                                         self.match["add"].in_place)

    def inline_when_compiled(self, direction):
        return self.match["add"].in_place

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        gemm, residual = args.gemm, args.extra_input
        if gemm.fp8:
            y, kept = gemm_forward(gemm)
            out = (residual.add_(y, alpha=args.scale) if args.in_place
                   else torch.add(residual, y, alpha=args.scale))
            return ForwardResult(out, (), forward_aux(gemm, kept))
        x, r2 = gemm.input, tokens_2d(residual)
        if args.in_place:  # a view of the residual (contiguous: the executor checks)
            r2.addmm_(tokens_2d(x), gemm.weight.t(), alpha=args.scale)
            return ForwardResult(residual)
        y = torch.addmm(r2, tokens_2d(x), gemm.weight.t(), alpha=args.scale)
        return ForwardResult(like_tokens(y, x))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.gemm, result.aux)

    @classmethod
    def example(cls):
        return Example((BasicLinear(32, 32), ConstantScale(0.5), AddExtraInput()), (16, 32),
                       ((16, 32),))
