"""L2Normalization: ``x * rsqrt(sum(x**2) + eps)`` over the last dimension (query-key
normalisation in attention), as TransformerEngine's ``ops.L2Normalization`` defines it."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.activations import compute_dtype
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class L2NormForwardArgs:
    input: Tensor
    eps: float


@attrs.define
class L2NormSaved:
    """The input and ``rstd = rsqrt(sum(x**2) + eps)`` (float32 for 16-bit inputs)."""

    input: Tensor
    rstd: Tensor


@attrs.define
class L2NormBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    rstd: Optional[Tensor]
    need_grad_input: bool


def l2_normalize(x: Tensor, eps: float) -> tuple:
    """``(y, rstd)``: ``y`` in ``x``'s dtype, computed in float32 for 16-bit inputs."""
    xf = x.to(compute_dtype(x.dtype))
    rstd = torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype), rstd


def l2_normalize_backward(dy: Tensor, x: Tensor, rstd: Tensor) -> Tensor:
    """``dx = rstd * (dy - x * rstd**2 * sum(dy * x))``, rounded once to ``dy``'s dtype."""
    dyf, xf = dy.to(rstd.dtype), x.to(rstd.dtype)
    dot = (dyf * xf).sum(-1, keepdim=True)
    return (rstd * (dyf - xf * (rstd * rstd * dot))).to(dy.dtype)


class L2Normalization(BasicOperation):
    """``y = x / sqrt(sum(x**2) + eps)`` over the last dimension; no parameters.

    Computed in float32 for 16-bit inputs (PyTorch ops on every device). Under an FP8
    recipe the output is quantized for the next GEMM like any op's.

    Parameters
    ----------
    eps : float
        Added to the sum of squares (default ``1e-6``, TransformerEngine's).

    Notes
    -----
    Saves an :class:`L2NormSaved` when the input needs a gradient.
    """

    fwd_args_type = L2NormForwardArgs
    bwd_args_type = L2NormBackwardArgs
    saved_type = L2NormSaved
    attribute_checks = {"eps": checks.real("eps", minimum=0.0)}

    def __init__(self, *, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def describe(self) -> str:
        return f"L2Normalization(eps={self.eps})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        if len(shape) < 1:
            raise ValueError(f"{self.describe()} normalises the last dimension; got a 0-d input")
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return L2NormForwardArgs(input, self.eps)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        y, rstd = l2_normalize(args.input, args.eps)
        return ForwardResult(y, (), (rstd,))

    def save_for_backward(self, args, result, ctxs):
        ctx = ctxs[0]
        if ctx.needs.input:
            ctx.saved = L2NormSaved(args.input, result.aux[0])

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx = ctxs[0]
        saved = ctx.saved
        if saved is None:
            return L2NormBackwardArgs(grad_output, None, None, False)
        return L2NormBackwardArgs(grad_output, saved.input, saved.rstd, ctx.needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(l2_normalize_backward(args.grad_output, args.input, args.rstd))

    def reference(self, x, extra_inputs, params):
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + self.eps), ()

    @classmethod
    def example(cls):
        return Example((cls(eps=1e-6),), (3, 5, 32))

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
