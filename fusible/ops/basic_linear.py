"""BasicLinear: ``y = x @ weight.T`` over any number of leading dimensions."""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch
from torch import nn

from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult

Tensor = torch.Tensor


def tokens_2d(t: Tensor) -> Tensor:
    """View a (..., features) tensor as (tokens, features) for a GEMM."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def like_tokens(y2: Tensor, t: Tensor) -> Tensor:
    """View a (tokens, features) GEMM result with the leading dimensions of ``t``."""
    return y2 if t.dim() == 2 else y2.view(*t.shape[:-1], y2.shape[-1])


def linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T (+ bias)``; with a bias, one GEMM with the bias epilogue."""
    x2 = tokens_2d(x)
    y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
    return like_tokens(y, x)


def linear_dgrad(grad_output: Tensor, weight: Tensor,
                 accumulate_into: Optional[Tensor] = None) -> Tensor:
    """``dy @ weight``; with ``accumulate_into``, ``that + dy @ weight`` in one GEMM."""
    dy2 = tokens_2d(grad_output)
    if accumulate_into is None:
        dx = torch.mm(dy2, weight)
    else:
        dx = torch.addmm(tokens_2d(accumulate_into), dy2, weight)
    return like_tokens(dx, grad_output)


def linear_wgrad(grad_output: Tensor, x: Tensor) -> Tensor:
    """``dy.T @ x`` summed over all tokens."""
    return torch.mm(tokens_2d(grad_output).t(), tokens_2d(x))


@attrs.define
class LinearForwardArgs:
    input: Tensor
    weight: Tensor


@attrs.define
class LinearBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    weight: Optional[Tensor]
    need_grad_input: bool
    need_grad_weight: bool


def check_not_parallel(op_name: str, tensor_parallel_mode, sequence_parallel,
                       tensor_parallel=False) -> None:
    if tensor_parallel_mode is not None or sequence_parallel or tensor_parallel:
        raise NotImplementedError(
            f"{op_name}: tensor parallelism (tensor_parallel_mode={tensor_parallel_mode!r}, "
            f"sequence_parallel={sequence_parallel!r}) is not available in this version of "
            f"fusible")


class BasicLinear(BasicOperation):
    """``y = x @ weight.T`` with ``weight`` of shape (out_features, in_features).

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the last dimension of the input and of the output.
    tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        Reserved for tensor parallelism; only the defaults are accepted now.
    device, dtype
        Where and in which dtype to create ``weight``.

    Notes
    -----
    Saves ``(input, weight)`` for backward: the input only when the weight
    needs a gradient (wgrad), the weight only when the input does (dgrad).
    Initialised like ``torch.nn.Linear``.
    """

    saved_fields = ("input", "weight")
    param_names = ("weight",)
    fwd_args_type = LinearForwardArgs
    bwd_args_type = LinearBackwardArgs

    def __init__(self, in_features: int, out_features: int, *, tensor_parallel_mode=None,
                 tensor_parallel_group=None, sequence_parallel: bool = False, device=None,
                 dtype=None):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"BasicLinear needs positive sizes, got {in_features=}, "
                             f"{out_features=}")
        check_not_parallel("BasicLinear", tensor_parallel_mode, sequence_parallel)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.tensor_parallel_mode = tensor_parallel_mode
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def describe(self) -> str:
        return f"BasicLinear(in_features={self.in_features}, out_features={self.out_features})"

    def diagram_label(self) -> str:
        return f"{self.in_features} \u2192 {self.out_features}"

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape:
            raise ValueError(f"{self.describe()} got a 0-d input; it needs (..., "
                             f"{self.in_features})")
        if shape[-1] != self.in_features:
            raise ValueError(f"BasicLinear(in_features={self.in_features}) got input with last "
                             f"dimension {shape[-1]}")
        self._check_param("weight", self.weight, dtype, device)
        return (*shape[:-1], self.out_features)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return LinearForwardArgs(input, params[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(linear_forward(args.input, args.weight))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args.input, args.weight)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return linear_backward_args(ctxs[0], grad_output)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(*linear_backward(args))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def save_linear(ctx, x: Tensor, weight: Tensor) -> None:
    """BasicLinear's saved layout: input for wgrad, weight for dgrad."""
    ctx.saved = (x if ctx.needs.params[0] else None, weight if ctx.needs.input else None)


def linear_backward_args(ctx, grad_output) -> LinearBackwardArgs:
    x, weight = ctx.saved
    return LinearBackwardArgs(grad_output, x, weight, ctx.needs.input, ctx.needs.params[0])


def linear_backward(args) -> tuple:
    """(dgrad or None, (wgrad or None,)) for LinearBackwardArgs-like args."""
    dx = linear_dgrad(args.grad_output, args.weight) if args.need_grad_input else None
    dw = linear_wgrad(args.grad_output, args.input) if args.need_grad_weight else None
    return dx, (dw,)
