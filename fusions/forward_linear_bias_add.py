"""ForwardLinearBiasAdd: GEMM accumulating into the residual, plus the bias."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import gemm_forward, linear_forward, tokens_2d
from fusible.functional.linear_records import GemmForwardArgs
from fusible.functional.linear_state import forward_aux, gemm_forward_args, save_linear
from fusible.ops import AddExtraInput, BasicLinear, Bias, ForwardResult
from fusible.ops.basic_linear import parallel_refusal


@attrs.define
class LinearBiasAddForwardArgs:
    gemm: GemmForwardArgs  # never tensor-parallel: the fusion refuses it
    bias: Optional[torch.Tensor]
    extra_input: torch.Tensor
    in_place: bool = False  # AddExtraInput(in_place=True): the GEMM accumulates into it


class ForwardLinearBiasAdd(FusedOperation):
    """``y = residual + x @ weight.T (+ bias)``: the GEMM reads the residual as its C matrix.

    Pattern: ``BasicLinear, Bias (optional), AddExtraInput``. Accepts every match without
    tensor parallelism.
    Under an FP8 recipe: ``torch._scaled_mm`` with the bias epilogue, then the residual add
    (``_scaled_mm`` cannot accumulate into C); takes its input in BasicLinear's format.
    Saves: BasicLinear's ``LinearSaved``; Bias and AddExtraInput save nothing.
    With ``AddExtraInput(in_place=True)`` the GEMM accumulates into the residual itself,
    the output (run inline when compiled: a custom op may not write into its inputs).
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias", optional=True),
                      Op(AddExtraInput, name="add"))
    fwd_args_type = LinearBiasAddForwardArgs

    @classmethod
    def accepts(cls, match, env):
        return parallel_refusal(match["linear"])

    def input_format(self, recipe, needs):
        return self.match["linear"].input_format(recipe, needs[:1])

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params if len(params) == 2 else (params[0], None)  # Bias is optional
        gemm = gemm_forward_args(input, weight, self.match["linear"].parallel, ctxs[0])
        return LinearBiasAddForwardArgs(gemm, bias, extra_inputs[0], self.match["add"].in_place)

    def inline_when_compiled(self, direction):
        return self.match["add"].in_place

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        gemm, residual = args.gemm, args.extra_input
        if gemm.fp8:
            y, kept = gemm_forward(gemm, args.bias)
            out = residual.add_(y) if args.in_place else y + residual
            return ForwardResult(out, (), forward_aux(gemm, kept))
        if not args.in_place:
            return ForwardResult(linear_forward(gemm.input, gemm.weight, args.bias, residual))
        # a view of the residual (contiguous: the executor checks), written by the GEMM
        y = tokens_2d(residual).addmm_(tokens_2d(gemm.input), gemm.weight.t())
        if args.bias is not None:
            y.add_(args.bias)
        return ForwardResult(residual)

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.gemm, result.aux)

    @classmethod
    def example(cls):
        return Example((BasicLinear(32, 32), Bias(32), AddExtraInput()), (16, 32), ((16, 32),))
