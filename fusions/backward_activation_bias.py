"""BackwardActivationBias: activation gradient and bias gradient in one pass."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.activations import dact_dbias
from fusible.ops import GELU, BackwardResult, Bias, ReLU, SiLU


@attrs.define
class ActivationBiasBackwardArgs:
    grad_output: torch.Tensor
    saved: Optional[torch.Tensor]
    kind: str
    need_grad_input: bool


class BackwardActivationBias(FusedOperation):
    """``dact = act'(.) * dy`` and ``dbias = dact.sum(tokens)`` in one pass over ``dy``.

    Pattern (forward order): ``Bias, GELU | ReLU | SiLU``; runs in the backward as
    the activation's then the bias's gradient.
    Accepts when the bias needs a gradient (otherwise there is nothing to fuse) and the
    activation keeps its saved tensor in high precision (no ``cache_quantized_input``).
    Reads: the activation's saved tensor (its input, or ReLU's output).
    Uses one Triton kernel on CUDA for tensors of 2**24 elements or more, two
    PyTorch ops elsewhere (see ``fusible.functional.activations.dact_dbias``). When the
    next stage takes the gradient in FP8, the Triton version writes it in FP8 directly.
    """

    direction = "backward"
    pattern = Pattern(Op(Bias, name="bias"),
                      Op(GELU, name="activation") | Op(ReLU, name="activation")
                      | Op(SiLU, name="activation"))
    bwd_args_type = ActivationBiasBackwardArgs
    quantizes_own_output = True
    rounds_gradient_before = ("activation",)  # dbias sums the rounded dact

    @classmethod
    def accepts(cls, match, env):
        act = match["activation"]
        if act.cache_quantized_input:
            return (f"{act.describe()} keeps its saved tensor in FP8; this fusion reads it in "
                    f"high precision")
        if not env.needs[match.indices[0]].params[0]:
            return "the Bias needs no gradient: nothing to fuse with the activation's"
        return True

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return ActivationBiasBackwardArgs(grad_output, ctxs[1].saved.tensor,
                                          self.match["activation"].kind, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        fmt = output_format if args.need_grad_input else None
        dact, dbias = dact_dbias(args.kind, args.grad_output, args.saved, fmt)
        return BackwardResult(dact if args.need_grad_input else None, (dbias,))

    @classmethod
    def example(cls):
        return Example((Bias(32), GELU(approximate="tanh")), (6, 32))
