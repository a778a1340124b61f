"""Quantize: hand FP8 out of a pipeline (fp8_output) or FP8 gradients back (fp8_grad)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult, pass_through
from fusible.quantization.float8_tensor import Fp8Able
from fusible.quantization.flow import to_fp8_format


@attrs.define
class QuantizeForwardArgs:
    input: Fp8Able
    fp8_dtype: Optional[torch.dtype]  # None: pass the input on unchanged


@attrs.define
class QuantizeBackwardArgs:
    grad_output: Fp8Able
    fp8_dtype: Optional[torch.dtype]  # None: pass the gradient on unchanged
    need_grad_input: bool


class Quantize(BasicOperation):
    """Quantize the pipeline's output (forward) or the gradient sent back (backward).

    Under an FP8 recipe, with ``forward=True`` the output is a
    :class:`~fusible.Float8Tensor` (E4M3 in the recipes here) that stays
    differentiable: ``y.dequantize()`` sends an E5M2 gradient back, and so does
    anything that hands one. With ``backward=True`` the gradient this op sends to
    the op before it is quantized to the recipe's gradient dtype (E5M2 for
    "hybrid"), whatever arrived. Without a recipe it is an identity.

    Parameters
    ----------
    forward : bool
        Quantize the output (fp8_output).
    backward : bool
        Quantize the gradient sent back (fp8_grad).

    Notes
    -----
    Saves nothing.
    """

    fwd_args_type = QuantizeForwardArgs
    bwd_args_type = QuantizeBackwardArgs

    def __init__(self, forward: bool = True, backward: bool = False):
        super().__init__()
        self.forward_fp8, self.backward_fp8 = bool(forward), bool(backward)

    def describe(self) -> str:
        return f"Quantize(forward={self.forward_fp8}, backward={self.backward_fp8})"

    def forward_args(self, input, params, extra_inputs, ctxs):
        recipe = ctxs[0].recipe
        fp8 = recipe.forward_dtype if recipe is not None and self.forward_fp8 else None
        return QuantizeForwardArgs(input, fp8)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x = args.input
        y = x if args.fp8_dtype is None else to_fp8_format(x, (args.fp8_dtype, False))
        return ForwardResult(y if y is not x else pass_through(x, True, in_custom_op))

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        recipe = ctxs[0].recipe
        fp8 = recipe.backward_dtype if recipe is not None and self.backward_fp8 else None
        return QuantizeBackwardArgs(grad_output, fp8, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        dy = args.grad_output
        dx = dy if args.fp8_dtype is None else to_fp8_format(dy, (args.fp8_dtype, False))
        return BackwardResult(dx if dx is not dy else pass_through(dy, True, in_custom_op))

    def extra_repr(self) -> str:
        return f"forward={self.forward_fp8}, backward={self.backward_fp8}"
