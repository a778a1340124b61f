"""ForwardLinearBiasAdd: GEMM accumulating into the residual, plus the bias."""

from typing import Optional

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.distributed import NOT_PARALLEL, TensorParallel
from fusible.ops import AddExtraInput, BasicLinear, Bias, ForwardResult
from fusible.ops.basic_linear import (fp8_forward_flags, gemm_forward, like_tokens, linear_aux,
                                      parallel_refusal, save_linear, tokens_2d)
from fusible.quantization.float8_tensor import Fp8Able


@attrs.define
class LinearBiasAddForwardArgs:
    input: Fp8Able
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    extra_input: torch.Tensor
    fp8_dtype: Optional[torch.dtype]
    keep_input_t: bool
    tp: TensorParallel = NOT_PARALLEL  # always: the fusion refuses tensor parallelism


@register_fusion
class ForwardLinearBiasAdd(FusedOperation):
    """``y = residual + x @ weight.T (+ bias)``: the GEMM reads the residual as its C matrix.

    Pattern: ``BasicLinear, Bias (optional), AddExtraInput``. Accepts every match without
    tensor parallelism.
    Under an FP8 recipe: ``torch._scaled_mm`` with the bias epilogue, then the residual add
    (``_scaled_mm`` cannot accumulate into C).
    Saves: BasicLinear's ``(input, weight)`` (FP8 copies under FP8); Bias and
    AddExtraInput save nothing.
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias", optional=True),
                      Op(AddExtraInput, name="add"))
    fwd_args_type = LinearBiasAddForwardArgs
    fp8_input_consumer = True

    @classmethod
    def accepts(cls, match, env):
        return parallel_refusal(match["linear"])

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params if len(params) == 2 else (params[0], None)  # Bias is optional
        return LinearBiasAddForwardArgs(input, weight, bias, extra_inputs[0],
                                        *fp8_forward_flags(ctxs[0]))

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x, w = args.input, args.weight
        if args.fp8_dtype is not None:
            y, x_q = gemm_forward(x, w, args.bias, args.fp8_dtype, args.keep_input_t)
            return ForwardResult(y + args.extra_input, (), linear_aux(args, x_q))
        y = torch.addmm(tokens_2d(args.extra_input), tokens_2d(x), w.t())
        if args.bias is not None:
            y.add_(args.bias)  # y is fresh: nothing else sees the in-place add
        return ForwardResult(like_tokens(y, x))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args, result.aux)
