"""PointwiseActivation: the base of GELU, ReLU and SiLU (``kind`` selects the math)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.activations import activation_backward, activation_forward, saves_output
from fusible.module import BasicOperation

# The base op, and what fusions covering an activation save and read
# (docs/writing_a_fusion.md, "Helpers for fusion authors").
__all__ = ["ActivationSaved", "PointwiseActivation", "save_activation"]

Tensor = torch.Tensor


@attrs.define
class ActivationForwardArgs:
    input: Tensor
    kind: str


@attrs.define
class ActivationBackwardArgs:
    grad_output: Tensor
    saved: Optional[Tensor]
    kind: str
    need_grad_input: bool


@attrs.define
class ActivationSaved:
    """A pointwise activation's saved record.

    Attributes
    ----------
    tensor : Tensor or None
        Its input, or its output where the gradient needs only that (ReLU); None when
        the input needs no gradient.
    """

    tensor: Optional[Tensor]


class PointwiseActivation(BasicOperation, abstract=True):
    """Base of the pointwise activations; a subclass names its ``kind`` (a key of
    ``fusible.functional.activations.ACTIVATIONS``).

    Notes
    -----
    Saves an :class:`ActivationSaved`: the input (the output for ReLU, whose gradient
    needs only its sign) when the input needs a gradient.
    """

    keeps_features = True

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
        return ActivationForwardArgs(input, self.kind)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False, output_format=None):
        return ForwardResult(activation_forward(args.kind, args.input, output_format))

    def save_for_backward(self, args, result, ctxs):
        save_activation(self, ctxs[0], args.input, result.output)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx = ctxs[0]
        return ActivationBackwardArgs(grad_output, ctx.saved.tensor, self.kind, ctx.needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(activation_backward(args.kind, args.grad_output, args.saved))


def save_activation(op: PointwiseActivation, ctx, x: Tensor, y: Tensor) -> None:
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
    """
    ctx.saved = ActivationSaved((y if op.saves_output else x) if ctx.needs.input else None)
