"""Activations: GELU, ReLU, SiLU (pointwise) and SwiGLU (gated)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.nn.functional as F

from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult

Tensor = torch.Tensor
aten = torch.ops.aten

# kind -> (forward, backward(dy, saved), saves_output); rules as data, shared by the
# basic ops and by fusions with an activation inside.
_ACTIVATIONS = {
    "gelu": (lambda x: F.gelu(x), lambda dy, x: aten.gelu_backward(dy, x), False),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda dy, x: aten.gelu_backward(dy, x, approximate="tanh"), False),
    "relu": (torch.relu, lambda dy, y: aten.threshold_backward(dy, y, 0), True),
    "silu": (F.silu, lambda dy, x: aten.silu_backward(dy, x), False),
}


def activation_forward(kind: str, x: Tensor) -> Tensor:
    """Apply the pointwise activation ``kind``."""
    return _ACTIVATIONS[kind][0](x)


def activation_backward(kind: str, grad_output: Tensor, saved: Tensor) -> Tensor:
    """Gradient of the activation ``kind`` from its saved input (or output, for ReLU)."""
    return _ACTIVATIONS[kind][1](grad_output, saved)


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


class PointwiseActivation(BasicOperation):
    """Base of the pointwise activations; ``kind`` selects the math.

    Notes
    -----
    Saves the input (the output for ReLU, whose gradient needs only its sign)
    when the input needs a gradient.
    """

    fwd_args_type = ActivationForwardArgs
    bwd_args_type = ActivationBackwardArgs
    saved_fields = ("input",)

    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def saves_output(self) -> bool:
        return _ACTIVATIONS[self.kind][2]

    def forward_args(self, input, params, extra_inputs, ctxs):
        return ActivationForwardArgs(input, self.kind)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(activation_forward(args.kind, args.input))

    def save_for_backward(self, args, result, ctxs):
        save_activation(self, ctxs[0], args.input, result.output)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx = ctxs[0]
        return ActivationBackwardArgs(grad_output, ctx.saved[0], self.kind, ctx.needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(activation_backward(args.kind, args.grad_output, args.saved))


def save_activation(op: PointwiseActivation, ctx, x: Tensor, y: Tensor) -> None:
    """A pointwise activation's saved layout: (input,) or (output,) for ReLU."""
    ctx.saved = ((y if op.saves_output else x) if ctx.needs.input else None,)


class GELU(PointwiseActivation):
    """Gaussian error linear unit, exact (``approximate="none"``) or tanh-approximated."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    @property
    def kind(self) -> str:
        return "gelu_tanh" if self.approximate == "tanh" else "gelu"

    def describe(self) -> str:
        return f"GELU(approximate={self.approximate!r})"

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLU(PointwiseActivation):
    """Rectified linear unit. Saves its output rather than its input."""

    saved_fields = ("output",)
    kind = "relu"


class SiLU(PointwiseActivation):
    """Sigmoid linear unit, ``x * sigmoid(x)``."""

    kind = "silu"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@attrs.define
class SwiGLUForwardArgs:
    input: Tensor


@attrs.define
class SwiGLUBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    need_grad_input: bool


class SwiGLU(BasicOperation):
    """Gated SiLU: ``a, b = x.chunk(2, -1); y = silu(a) * b``.

    The last dimension halves. Computes in float32 for 16-bit inputs.

    Notes
    -----
    Saves its input when the input needs a gradient.
    """

    fwd_args_type = SwiGLUForwardArgs
    bwd_args_type = SwiGLUBackwardArgs
    saved_fields = ("input",)

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape or shape[-1] % 2:
            raise ValueError(f"SwiGLU needs an even last dimension, got input shape "
                             f"{tuple(shape)}")
        return (*shape[:-1], shape[-1] // 2)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return SwiGLUForwardArgs(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x = args.input
        a, b = x.to(_compute_dtype(x.dtype)).chunk(2, -1)
        return ForwardResult((F.silu(a) * b).to(x.dtype))

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = (args.input if ctxs[0].needs.input else None,)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return SwiGLUBackwardArgs(grad_output, ctxs[0].saved[0], ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        x = args.input
        cdt = _compute_dtype(x.dtype)
        a, b = x.to(cdt).chunk(2, -1)
        dy = args.grad_output.to(cdt)
        da = aten.silu_backward(dy * b, a)
        db = dy * F.silu(a)
        return BackwardResult(torch.cat([da, db], -1).to(x.dtype))
