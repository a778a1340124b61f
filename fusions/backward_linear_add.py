"""BackwardLinearAdd: dgrad GEMM accumulating into the branch's gradient."""

from typing import Optional

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, register_fusion
from fusible.ops import BackwardResult, BasicLinear, MakeExtraOutput
from fusible.distributed import NOT_PARALLEL, TensorParallel
from fusible.ops.basic_linear import linear_backward, linear_saved, parallel_refusal
from fusible.quantization.float8_tensor import Fp8Able


@attrs.define
class LinearAddBackwardArgs:
    grad_output: Fp8Able
    grad_extra_output: Optional[torch.Tensor]
    input: Optional[Fp8Able]
    weight: Optional[Fp8Able]
    grad_fp8_dtype: Optional[torch.dtype]
    need_grad_input: bool
    need_grad_weight: bool
    tp: TensorParallel = NOT_PARALLEL


@register_fusion
class BackwardLinearAdd(FusedOperation):
    """``dx = d_branch + dy @ weight`` in one GEMM (the branch gradient as its C matrix).

    Pattern (forward order): ``MakeExtraOutput, BasicLinear``; in the backward the
    linear's dgrad is accumulated into the gradient of the extra output.
    Accepts when the input needs a gradient (otherwise there is no dgrad).
    Reads: BasicLinear's saved ``(input, weight)``; computes its wgrad too. Under an FP8
    recipe the dgrad is an FP8 GEMM followed by the add.
    """

    direction = "backward"
    pattern = Pattern(Op(MakeExtraOutput, name="branch"), Op(BasicLinear, name="linear"))
    bwd_args_type = LinearAddBackwardArgs
    fp8_grad_consumer = True
    handles_communication = True  # row layers: gemm_backward gathers (accepts refuses column)

    @classmethod
    def accepts(cls, match, env):
        if not env.needs[match.indices[0]].input:
            return "MakeExtraOutput's input needs no gradient: there is no dgrad to accumulate"
        return parallel_refusal(match["linear"], ("", "row"))

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        linear = ctxs[1]
        x, weight, grad_dtype = linear_saved(linear)
        return LinearAddBackwardArgs(grad_output, grad_extra_outputs[0], x, weight, grad_dtype,
                                     True, linear.needs.params[0], self.match["linear"].tp)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(*linear_backward(args, accumulate_into=args.grad_extra_output))
