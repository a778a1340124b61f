"""PointwiseActivation: the base of GELU, ReLU and SiLU (``kind`` selects the math)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core import checks
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.activations import activation_backward, activation_forward, saves_output
from fusible.module import BasicOperation
from fusible.quantization.casts.dequantize import dequantize
from fusible.quantization.casts.tensorwise import cast_tensorwise

# The base op, and what fusions covering an activation save and read
# (docs/writing_a_fusion.md, "Helpers for fusion authors").
__all__ = ["ActivationSaved", "PointwiseActivation", "save_activation"]

Tensor = torch.Tensor


@attrs.define
class ActivationForwardArgs:
    input: Tensor
    kind: str
    cache_quantized: bool  # the saved tensor kept in FP8 (cache_quantized_input)
    saves_output: bool


@attrs.define
class ActivationBackwardArgs:
    grad_output: Tensor
    saved: Optional[Tensor]
    kind: str
    need_grad_input: bool
    saved_fp8: Optional[Tensor] = None  # with cache_quantized_input: the FP8 data
    saved_scale_inv: Optional[Tensor] = None


@attrs.define
class ActivationSaved:
    """A pointwise activation's saved record.

    Attributes
    ----------
    tensor : Tensor or None
        Its input, or its output where the gradient needs only that (ReLU); None when
        the input needs no gradient, or when it is kept in FP8.
    tensor_fp8, scale_inv : Tensor or None
        With ``cache_quantized_input``: that tensor's E4M3 data and inverse scale.
    """

    tensor: Optional[Tensor]
    tensor_fp8: Optional[Tensor] = None
    scale_inv: Optional[Tensor] = None


class PointwiseActivation(BasicOperation, abstract=True):
    """Base of the pointwise activations; a subclass names its ``kind`` (a key of
    ``fusible.functional.activations.ACTIVATIONS``).

    Parameters
    ----------
    cache_quantized_input : bool
        Save the tensor the backward reads in FP8 (E4M3, a current per-tensor scale)
        rather than in its own dtype: half the memory of a 16-bit activation, at the cost
        of a cast and of the backward computing from the quantized values
        (TransformerEngine's option). The fusions that read the saved tensor in high
        precision (ForwardLinearBiasActivation, BackwardActivationBias) are refused then.

    Notes
    -----
    Saves an :class:`ActivationSaved`: the input (the output for ReLU, whose gradient
    needs only its sign) when the input needs a gradient, or its FP8 copy.
    """

    keeps_features = True
    attribute_checks = {"cache_quantized_input": checks.boolean("cache_quantized_input")}

    def __init__(self, *, cache_quantized_input: bool = False):
        super().__init__()
        self.cache_quantized_input = cache_quantized_input

    def extra_repr(self) -> str:
        return "cache_quantized_input=True" if self.cache_quantized_input else ""

    def describe(self) -> str:
        options = self.extra_repr()
        return f"{type(self).__name__}({options})" if options else type(self).__name__

    fwd_args_type = ActivationForwardArgs
    bwd_args_type = ActivationBackwardArgs
    saved_type = ActivationSaved
    # GELU and SiLU write the next GEMM's FP8 input themselves on CUDA (see
    # fusible.functional.activations.activation_forward)
    quantizes_own_output = True

    @property
    def kind(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must name its kind")

    @property
    def saves_output(self) -> bool:
        return saves_output(self.kind)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return ActivationForwardArgs(input, self.kind,
                                     self.cache_quantized_input and ctxs[0].needs.input,
                                     self.saves_output)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False, output_format=None):
        y = activation_forward(args.kind, args.input, output_format)
        if not args.cache_quantized:
            return ForwardResult(y)
        kept = y if args.saves_output else args.input
        if type(kept) is not Tensor:
            kept = args.input  # an FP8 output (the next GEMM's): ReLU's sign is its input's
        return ForwardResult(y, (), tuple(cast_tensorwise(kept, torch.float8_e4m3fn, False)))

    def save_for_backward(self, args, result, ctxs):
        save_activation(self, ctxs[0], args.input, result.output,
                        result.aux if args.cache_quantized else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx = ctxs[0]
        saved = ctx.saved
        return ActivationBackwardArgs(grad_output, saved.tensor, self.kind, ctx.needs.input,
                                      saved.tensor_fp8, saved.scale_inv)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        if not args.need_grad_input:
            return BackwardResult(None)
        saved = args.saved
        if saved is None:  # cached in FP8; the output gradient has the input's dtype
            saved = dequantize(args.saved_fp8, args.saved_scale_inv, args.grad_output.dtype)
        return BackwardResult(activation_backward(args.kind, args.grad_output, saved))


def save_activation(op: PointwiseActivation, ctx, x: Tensor, y: Tensor,
                    quantized: Optional[tuple] = None) -> None:
    """Set ``ctx.saved`` to the activation's :class:`ActivationSaved`, as the op saves it.

    Parameters
    ----------
    op : PointwiseActivation
        The covered activation.
    ctx : OperationContext
        Its context.
    x, y : Tensor
        Its input and output: the input is saved, or the output for ReLU (nothing where
        the input needs no gradient).
    quantized : tuple of Tensor, optional
        With ``cache_quantized_input``: the FP8 data and inverse scale saved instead.
    """
    if not ctx.needs.input:
        ctx.saved = ActivationSaved(None)
    elif quantized is not None:
        ctx.saved = ActivationSaved(None, *quantized)
    else:
        ctx.saved = ActivationSaved(y if op.saves_output else x)
