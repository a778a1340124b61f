"""LayerNorm over the trailing ``normalized_shape`` dimensions."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
from torch import nn

from fusible import distributed
from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult

Tensor = torch.Tensor


def normalized_shape_tuple(op_name: str, normalized_shape) -> tuple:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(int(s) <= 0 for s in shape):
        raise ValueError(f"{op_name} needs positive sizes, got normalized_shape={normalized_shape!r}")
    return tuple(int(s) for s in shape)


def check_trailing(op, shape, normalized_shape) -> None:
    n = len(normalized_shape)
    if len(shape) < n or tuple(shape[-n:]) != normalized_shape:
        raise ValueError(f"{op.describe()} got input of shape {tuple(shape)}; its trailing "
                         f"dimensions must be {normalized_shape}")


def _compute_copies(*tensors):
    """float32 copies of 16-bit CPU tensors: PyTorch's CPU kernel keeps mean and rstd in
    the input dtype, too coarse for the backward. CUDA accumulates in float32 already."""
    x = tensors[0]
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return tuple(t.float() for t in tensors)
    return tensors


@attrs.define
class LayerNormForwardArgs:
    input: Tensor
    weight: Tensor
    bias: Tensor
    normalized_shape: list[int]
    eps: float


@attrs.define
class LayerNormBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    mean: Optional[Tensor]
    rstd: Optional[Tensor]
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    normalized_shape: list[int]
    need_grad_input: bool
    need_grad_weight: bool
    need_grad_bias: bool


class LayerNorm(BasicOperation):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing dimensions.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        Trailing dimensions to normalise over.
    eps : float
        Added to the variance.
    sequence_parallel : bool
        The input's tokens (dim 0) are split over ``tensor_parallel_group`` (as around
        sequence-parallel linear layers): the parameter gradients, summed by each rank over
        its own tokens, are all-reduced over the group after the backward stage.
    tensor_parallel_group : torch.distributed.ProcessGroup, optional
        The group of ``sequence_parallel``; the default group when None.
    device, dtype
        Where and in which dtype to create ``weight`` (ones) and ``bias`` (zeros).

    Notes
    -----
    Saves ``(input, mean, rstd, weight, bias)`` when any gradient is needed.
    """

    saved_fields = ("input", "mean", "rstd", "weight", "bias")
    param_names = ("weight", "bias")
    fwd_args_type = LayerNormForwardArgs
    bwd_args_type = LayerNormBackwardArgs

    def __init__(self, normalized_shape, *, eps: float = 1e-5, sequence_parallel: bool = False,
                 tensor_parallel_group=None, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = normalized_shape_tuple("LayerNorm", normalized_shape)
        self.sequence_parallel = sequence_parallel
        self.sequence_parallel_group = distributed.sequence_parallel(
            self.describe(), sequence_parallel, tensor_parallel_group)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))

    def describe(self) -> str:
        sp = ", sequence_parallel=True" if getattr(self, "sequence_parallel", False) else ""
        return f"LayerNorm(normalized_shape={self.normalized_shape}{sp})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        check_trailing(self, shape, self.normalized_shape)
        self._check_param("weight", self.weight, dtype, device)
        self._check_param("bias", self.bias, dtype, device)
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params
        return LayerNormForwardArgs(input, weight, bias, list(self.normalized_shape), self.eps)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x, w, b = _compute_copies(args.input, args.weight, args.bias)
        y, mean, rstd = torch.native_layer_norm(x, args.normalized_shape, w, b, args.eps)
        return ForwardResult(y.to(args.input.dtype), (), (mean, rstd))

    def save_for_backward(self, args, result, ctxs):
        ctx = ctxs[0]
        if ctx.needs.any:
            ctx.saved = (args.input, *result.aux, args.weight, args.bias)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx = ctxs[0]
        return LayerNormBackwardArgs(grad_output, *ctx.saved, list(self.normalized_shape),
                                     ctx.needs.input, *ctx.needs.params)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        mask = [args.need_grad_input, args.need_grad_weight, args.need_grad_bias]
        dy, x, w, b = _compute_copies(args.grad_output, args.input, args.weight, args.bias)
        grads = torch.ops.aten.native_layer_norm_backward(
            dy, x, args.normalized_shape, args.mean, args.rstd, w, b, mask)
        dx, dw, db = (None if g is None else g.to(args.grad_output.dtype) for g in grads)
        return BackwardResult(dx, (dw, db))

    def extra_repr(self) -> str:
        return f"normalized_shape={self.normalized_shape}, eps={self.eps}"
