"""RMSNorm: ``x * rsqrt(mean(x**2) + eps) * weight`` over the trailing dimensions."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
from torch import nn

from fusible import distributed
from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult
from fusible.ops.layer_norm import check_trailing, normalized_shape_tuple

Tensor = torch.Tensor


def _float(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


@attrs.define
class RMSNormForwardArgs:
    input: Tensor
    weight: Tensor
    normalized_shape: list[int]
    eps: float


@attrs.define
class RMSNormBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    rstd: Optional[Tensor]
    weight: Optional[Tensor]
    normalized_shape: list[int]
    need_grad_input: bool
    need_grad_weight: bool


class RMSNorm(BasicOperation):
    """``x * rsqrt(mean(x**2) + eps) * weight``, computed in float32 for 16-bit inputs.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        Trailing dimensions to normalise over.
    eps : float
        Added to the mean square.
    sequence_parallel : bool
        The input's tokens (dim 0) are split over ``tensor_parallel_group`` (as around
        sequence-parallel linear layers): the parameter gradients, summed by each rank over
        its own tokens, are all-reduced over the group after the backward stage.
    tensor_parallel_group : torch.distributed.ProcessGroup, optional
        The group of ``sequence_parallel``; the default group when None.
    device, dtype
        Where and in which dtype to create ``weight`` (ones).

    Notes
    -----
    Saves ``(input, rstd, weight)`` when any gradient is needed; ``rstd`` is
    float32 for 16-bit inputs.
    """

    saved_fields = ("input", "rstd", "weight")
    param_names = ("weight",)
    fwd_args_type = RMSNormForwardArgs
    bwd_args_type = RMSNormBackwardArgs

    def __init__(self, normalized_shape, *, eps: float = 1e-5, sequence_parallel: bool = False,
                 tensor_parallel_group=None, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = normalized_shape_tuple("RMSNorm", normalized_shape)
        self.sequence_parallel = sequence_parallel
        self.sequence_parallel_group = distributed.sequence_parallel(
            self.describe(), sequence_parallel, tensor_parallel_group)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))

    def describe(self) -> str:
        sp = ", sequence_parallel=True" if getattr(self, "sequence_parallel", False) else ""
        return f"RMSNorm(normalized_shape={self.normalized_shape}{sp})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        check_trailing(self, shape, self.normalized_shape)
        self._check_param("weight", self.weight, dtype, device)
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return RMSNormForwardArgs(input, params[0], list(self.normalized_shape), self.eps)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x = _float(args.input)
        dims = tuple(range(-len(args.normalized_shape), 0))
        rstd = torch.rsqrt(x.square().mean(dims, keepdim=True) + args.eps)
        y = (x * rstd * _float(args.weight)).to(args.input.dtype)
        return ForwardResult(y, (), (rstd,))

    def save_for_backward(self, args, result, ctxs):
        ctx = ctxs[0]
        if ctx.needs.any:
            ctx.saved = (args.input, result.aux[0], args.weight)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx = ctxs[0]
        return RMSNormBackwardArgs(grad_output, *ctx.saved, list(self.normalized_shape),
                                   ctx.needs.input, ctx.needs.params[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dtype = args.grad_output.dtype
        dims = tuple(range(-len(args.normalized_shape), 0))
        dy, x_hat = _float(args.grad_output), _float(args.input) * args.rstd
        dx = dw = None
        if args.need_grad_input:
            g = dy * _float(args.weight)
            dx = (args.rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))).to(dtype)
        if args.need_grad_weight:
            dw = (dy * x_hat).reshape(-1, *args.normalized_shape).sum(0).to(dtype)
        return BackwardResult(dx, (dw,))

    def extra_repr(self) -> str:
        return f"normalized_shape={self.normalized_shape}, eps={self.eps}"
