"""Bias: ``y = x + bias`` along the last dimension."""

from __future__ import annotations

import attrs
import torch
from torch import nn

from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult, pass_through
from fusible.ops.basic_linear import check_not_parallel, tokens_2d

Tensor = torch.Tensor


def bias_grad(grad_output: Tensor) -> Tensor:
    """Sum of the gradient over all tokens."""
    return tokens_2d(grad_output).sum(0)


@attrs.define
class BiasForwardArgs:
    input: Tensor
    bias: Tensor


@attrs.define
class BiasBackwardArgs:
    grad_output: Tensor
    need_grad_input: bool
    need_grad_bias: bool


class Bias(BasicOperation):
    """``y = x + bias``, ``bias`` of shape (size,), broadcast over leading dimensions.

    Parameters
    ----------
    size : int
        Size of the last dimension.
    tensor_parallel, tensor_parallel_group
        Reserved for tensor parallelism; only the defaults are accepted now.
    device, dtype
        Where and in which dtype to create ``bias`` (initialised to zeros).

    Notes
    -----
    Saves nothing: ``dbias`` is the gradient summed over tokens and ``dx = dy``.
    """

    param_names = ("bias",)
    fwd_args_type = BiasForwardArgs
    bwd_args_type = BiasBackwardArgs

    def __init__(self, size: int, *, tensor_parallel: bool = False, tensor_parallel_group=None,
                 device=None, dtype=None):
        super().__init__()
        if size <= 0:
            raise ValueError(f"Bias needs a positive size, got {size=}")
        check_not_parallel("Bias", None, False, tensor_parallel)
        self.size = int(size)
        self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))

    def describe(self) -> str:
        return f"Bias(size={self.size})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        self._check_last_dim(shape, self.size, "size")
        self._check_param("bias", self.bias, dtype, device)
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return BiasForwardArgs(input, params[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input + args.bias)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs = ctxs[0].needs
        return BiasBackwardArgs(grad_output, needs.input, needs.params[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(pass_through(args.grad_output, args.need_grad_input, in_custom_op),
                              (bias_grad(args.grad_output) if args.need_grad_bias else None,))

    def extra_repr(self) -> str:
        return f"size={self.size}"

