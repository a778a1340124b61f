"""ForwardLinearBias: BasicLinear + Bias as one GEMM with the bias epilogue."""

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.ops import BasicLinear, Bias, ForwardResult
from fusible.ops.basic_linear import linear_forward, save_linear


@attrs.define
class LinearBiasForwardArgs:
    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor


@register_fusion
class ForwardLinearBias(FusedOperation):
    """``y = x @ weight.T + bias`` in one ``torch.addmm`` (cuBLASLt bias epilogue on CUDA).

    Pattern: ``BasicLinear, Bias``. Accepts every match.
    Saves: BasicLinear's ``(input, weight)`` as BasicLinear itself would; Bias saves
    nothing. The backward is planned separately.
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias"))
    fwd_args_type = LinearBiasForwardArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params  # the covered ops' parameters, in order
        return LinearBiasForwardArgs(input, weight, bias)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(linear_forward(args.input, args.weight, args.bias))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.input, args.weight)
