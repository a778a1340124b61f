"""ForwardLinearBias: BasicLinear + Bias as one GEMM with the bias epilogue."""

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import gemm_forward
from fusible.functional.linear_records import GemmForwardArgs
from fusible.functional.linear_state import forward_aux, gemm_forward_args, save_linear
from fusible.ops import BasicLinear, Bias, ForwardResult
from fusible.ops.basic_linear import parallel_refusal


@attrs.define
class LinearBiasForwardArgs:
    gemm: GemmForwardArgs
    bias: torch.Tensor


class ForwardLinearBias(FusedOperation):
    """``y = x @ weight.T + bias`` in one GEMM with the bias epilogue.

    ``torch.addmm`` (cuBLASLt's bias epilogue on CUDA); under an FP8 recipe
    ``torch._scaled_mm`` with its bias epilogue.
    Pattern: ``BasicLinear, Bias``. Accepts every match but row-parallel layers (their
    bias is added once, after the reduction); column-parallel ones gather their input
    first under sequence parallelism, as BasicLinear does.
    FP8: takes its input in BasicLinear's format.
    Saves: BasicLinear's ``LinearSaved`` as BasicLinear itself would; Bias saves nothing.
    The backward is planned separately.
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias"))
    fwd_args_type = LinearBiasForwardArgs
    handles_communication = True  # column layers: gemm_forward gathers (accepts refuses row)

    @classmethod
    def accepts(cls, match, env):
        return parallel_refusal(match["linear"], (None, "column"),
                                "a row-parallel output is summed over the group after the "
                                "GEMM: the bias is added once, after the sum, not by every "
                                "rank's GEMM epilogue")

    def input_format(self, recipe, needs):
        return self.match["linear"].input_format(recipe, needs[:1])

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params  # the covered ops' parameters, in order
        return LinearBiasForwardArgs(
            gemm_forward_args(input, weight, self.match["linear"].parallel, ctxs[0]), bias)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        y, kept = gemm_forward(args.gemm, args.bias)
        return ForwardResult(y, (), forward_aux(args.gemm, kept))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.gemm, result.aux)

    @classmethod
    def example(cls):
        return Example((BasicLinear(32, 48), Bias(48)), (2, 8, 32))
