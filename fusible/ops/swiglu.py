"""SwiGLU: the gated SiLU of Llama-style feed-forward blocks."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.nn.functional as F

from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.activations import swiglu_backward, swiglu_forward
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class SwiGLUForwardArgs:
    input: Tensor


@attrs.define
class SwiGLUBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    need_grad_input: bool


@attrs.define
class SwiGLUSaved:
    """SwiGLU's saved record: its input, when the input needs a gradient."""

    input: Optional[Tensor]


class SwiGLU(BasicOperation):
    """Gated SiLU: ``a, b = x.chunk(2, -1); y = silu(a) * b``.

    The last dimension halves. Computes in float32 for 16-bit inputs; on CUDA one Triton
    kernel each way, which under an FP8 recipe writes the next linear layer's input (or
    the previous one's gradient) in FP8 directly.

    Notes
    -----
    Saves a :class:`SwiGLUSaved`: its input when the input needs a gradient.
    """

    fwd_args_type = SwiGLUForwardArgs
    bwd_args_type = SwiGLUBackwardArgs
    saved_type = SwiGLUSaved
    quantizes_own_output = True

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape or shape[-1] % 2:
            raise ValueError(f"SwiGLU needs an even last dimension, got input shape "
                             f"{tuple(shape)}")
        return (*shape[:-1], shape[-1] // 2)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return SwiGLUForwardArgs(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False, output_format=None):
        return ForwardResult(swiglu_forward(args.input, output_format))

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = SwiGLUSaved(args.input if ctxs[0].needs.input else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return SwiGLUBackwardArgs(grad_output, ctxs[0].saved.input, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(swiglu_backward(args.grad_output, args.input, output_format))

    def reference(self, x, extra_inputs, params):
        a, b = x.chunk(2, -1)
        return F.silu(a) * b, ()

    @classmethod
    def example(cls):
        return Example((cls(),), (3, 5, 64))
