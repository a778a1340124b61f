"""ForwardLinearBiasAdd: GEMM accumulating into the residual, plus the bias."""

from typing import Optional

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.ops import AddExtraInput, BasicLinear, Bias, ForwardResult
from fusible.ops.basic_linear import like_tokens, save_linear, tokens_2d


@attrs.define
class LinearBiasAddForwardArgs:
    input: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    extra_input: torch.Tensor


@register_fusion
class ForwardLinearBiasAdd(FusedOperation):
    """``y = residual + x @ weight.T (+ bias)``: the GEMM reads the residual as its C matrix.

    Pattern: ``BasicLinear, Bias (optional), AddExtraInput``. Accepts every match.
    Saves: BasicLinear's ``(input, weight)``; Bias and AddExtraInput save nothing.
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias", optional=True),
                      Op(AddExtraInput, name="add"))
    fwd_args_type = LinearBiasAddForwardArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params if len(params) == 2 else (params[0], None)  # Bias is optional
        return LinearBiasAddForwardArgs(input, weight, bias, extra_inputs[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x, w = args.input, args.weight
        y = torch.addmm(tokens_2d(args.extra_input), tokens_2d(x), w.t())
        if args.bias is not None:
            y.add_(args.bias)  # y is fresh: nothing else sees the in-place add
        return ForwardResult(like_tokens(y, x))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.input, args.weight)
