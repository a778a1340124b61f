"""ForwardLinearBias: BasicLinear + Bias as one GEMM with the bias epilogue."""

from typing import Optional

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.ops import BasicLinear, Bias, ForwardResult
from fusible.distributed import NOT_PARALLEL, TensorParallel
from fusible.ops.basic_linear import (fp8_forward_flags, gemm_forward, linear_aux,
                                      parallel_refusal, save_linear)
from fusible.quantization.float8_tensor import Fp8Able


@attrs.define
class LinearBiasForwardArgs:
    input: Fp8Able
    weight: torch.Tensor
    bias: torch.Tensor
    fp8_dtype: Optional[torch.dtype]
    keep_input_t: bool
    tp: TensorParallel = NOT_PARALLEL


@register_fusion
class ForwardLinearBias(FusedOperation):
    """``y = x @ weight.T + bias`` in one GEMM with the bias epilogue.

    ``torch.addmm`` (cuBLASLt's bias epilogue on CUDA); under an FP8 recipe
    ``torch._scaled_mm`` with its bias epilogue.
    Pattern: ``BasicLinear, Bias``. Accepts every match but row-parallel layers (their
    bias is added once, after the reduction); column-parallel ones gather their input
    first under sequence parallelism, as BasicLinear does.
    Saves: BasicLinear's ``(input, weight)`` as BasicLinear itself would (their FP8
    copies under FP8); Bias saves nothing. The backward is planned separately.
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias"))
    fwd_args_type = LinearBiasForwardArgs
    fp8_input_consumer = True
    handles_communication = True  # column layers: gemm_forward gathers (accepts refuses row)

    @classmethod
    def accepts(cls, match, env):
        return parallel_refusal(match["linear"], ("", "column"),
                                "a row-parallel output is summed over the group after the "
                                "GEMM: the bias is added once, after the sum, not by every "
                                "rank's GEMM epilogue")

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params  # the covered ops' parameters, in order
        return LinearBiasForwardArgs(input, weight, bias, *fp8_forward_flags(ctxs[0]),
                                     self.match["linear"].tp)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        y, x_q = gemm_forward(args.input, args.weight, args.bias, args.fp8_dtype,
                              args.keep_input_t, args.tp)
        return ForwardResult(y, (), linear_aux(args, x_q))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args, result.aux)
