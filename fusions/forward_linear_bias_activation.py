"""ForwardLinearBiasActivation: GEMM + bias + GELU/ReLU in one ``torch._addmm_activation``."""

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import like_tokens, tokens_2d
from fusible.functional.linear_records import GemmForwardArgs
from fusible.functional.linear_state import gemm_forward_args, save_linear
from fusible.ops import GELU, BasicLinear, Bias, ForwardResult, ReLU
from fusible.ops.basic_linear import parallel_refusal
from fusible.ops.pointwise_activation import save_activation

# The GELU each backend's epilogue computes: cuBLASLt's is the tanh form; the CPU
# kernel applies exact GELU after the GEMM.
EPILOGUE_GELU = {"cuda": "tanh", "cpu": "none"}


@attrs.define
class LinearBiasActivationForwardArgs:
    gemm: GemmForwardArgs
    bias: torch.Tensor
    use_gelu: bool


class ForwardLinearBiasActivation(FusedOperation):
    """``act(x @ weight.T + bias)`` with the activation in the GEMM epilogue.

    Pattern: ``BasicLinear, Bias, GELU | ReLU``.
    Accepts on devices with an epilogue (CUDA: GELU tanh, CPU: exact GELU; ReLU on
    both), and GELU only when its input needs no gradient: the epilogue does not
    return the pre-activation GELU's backward needs. ReLU's backward needs only
    its output, so ReLU fuses in training too. On CUDA, GELU fuses for 16-bit
    dtypes only: cuBLASLt's epilogue is less accurate than float32 (measured
    about 6e-5 relative on an H200).
    Refuses under an FP8 recipe (no FP8 activation epilogue), with tensor parallelism and
    with the activation's ``cache_quantized_input``.
    Saves: BasicLinear's ``LinearSaved``; ReLU's output.
    """

    direction = "forward"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(Bias, name="bias"),
                      Op(GELU, name="activation") | Op(ReLU, name="activation"))
    fwd_args_type = LinearBiasActivationForwardArgs

    @classmethod
    def accepts(cls, match, env):
        act = match["activation"]
        if act.cache_quantized_input:
            return (f"{act.describe()} saves its tensor in FP8, which its own stage casts; "
                    f"the epilogue gives only the output in high precision")
        if parallel_refusal(match["linear"]) is not True:
            return parallel_refusal(match["linear"])
        if env.recipe_of(match.indices[0]) is not None:  # a GEMM the FP8 policy keeps: fine
            return "torch._scaled_mm has no activation epilogue for FP8 GEMMs"
        if env.device_type not in EPILOGUE_GELU:
            return f"no GEMM activation epilogue on {env.device_type}"
        if not isinstance(act, GELU):
            return True
        wanted = EPILOGUE_GELU[env.device_type]
        if act.approximate != wanted:
            return (f"the {env.device_type} epilogue computes GELU(approximate={wanted!r}), "
                    f"this is GELU(approximate={act.approximate!r})")
        if env.needs[match.indices[2]].input:
            return "GELU's backward needs the pre-activation, which the epilogue does not return"
        if env.device_type == "cuda" and env.dtype == torch.float32:
            return ("cuBLASLt's GELU epilogue is accurate to about 1e-4, short of float32; "
                    "it is used for 16-bit dtypes only")
        return True

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params
        gemm = gemm_forward_args(input, weight, self.match["linear"].parallel, ctxs[0])
        return LinearBiasActivationForwardArgs(gemm, bias,
                                               isinstance(self.match["activation"], GELU))

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x, w = args.gemm.input, args.gemm.weight
        y = torch._addmm_activation(args.bias, tokens_2d(x), w.t(), use_gelu=args.use_gelu)
        return ForwardResult(like_tokens(y, x))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.gemm, ())
        # Only ReLU reaches here with a backward (accepts refuses GELU then): it saves y.
        save_activation(self.match["activation"], ctxs[2], None, result.output)

    @classmethod
    def example(cls):
        return Example((BasicLinear(32, 48), Bias(48), ReLU()), (6, 32), fp8=False)
