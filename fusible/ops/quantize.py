"""Quantize: hand FP8 out of a pipeline (fp8_output) or FP8 gradients back (fp8_grad)."""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation
from fusible.quantization.format import Float8Format, bound_format, to_format
from fusible.quantization.tensor.float8_tensor import Fp8Able


@attrs.define
class QuantizeForwardArgs:
    input: Fp8Able
    format: Optional[Float8Format]  # None: pass the input on unchanged


@attrs.define
class QuantizeBackwardArgs:
    grad_output: Fp8Able
    format: Optional[Float8Format]  # None: pass the gradient on unchanged
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

    keeps_features = True
    scaling_state_roles = ("input", "grad")  # its output's (a GEMM input's) and gradient's

    fwd_args_type = QuantizeForwardArgs
    bwd_args_type = QuantizeBackwardArgs

    attribute_checks = {"forward_fp8": checks.boolean("forward"),
                        "backward_fp8": checks.boolean("backward")}

    def __init__(self, forward: bool = True, backward: bool = False):
        super().__init__()
        self.forward_fp8, self.backward_fp8 = forward, backward

    def describe(self) -> str:
        return f"Quantize(forward={self.forward_fp8}, backward={self.backward_fp8})"

    def forward_args(self, input, params, extra_inputs, ctxs):
        recipe = ctxs[0].recipe
        fmt = recipe.input_format() if recipe is not None and self.forward_fp8 else None
        return QuantizeForwardArgs(input, bound_format(fmt, ctxs[0], "input"))

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(to_format(args.input, args.format))

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        recipe = ctxs[0].recipe
        fmt = recipe.grad_format() if recipe is not None and self.backward_fp8 else None
        return QuantizeBackwardArgs(grad_output, bound_format(fmt, ctxs[0], "grad"),
                                    ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(to_format(args.grad_output, args.format))

    def quantizes(self, recipe, direction):
        return recipe is not None and (self.forward_fp8 if direction == "forward"
                                       else self.backward_fp8)

    def reference(self, x, extra_inputs, params):
        return x, ()  # the reference does not quantize

    @classmethod
    def example(cls):
        return Example((cls(forward=True, backward=True),), (16, 32), fp8=False)

    def extra_repr(self) -> str:
        return f"forward={self.forward_fp8}, backward={self.backward_fp8}"
