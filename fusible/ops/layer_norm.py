"""LayerNorm over the trailing ``normalized_shape`` dimensions (with a zero-centred gamma:
``* (1 + weight)``)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from fusible.core.arg_types import DTypeArg, DeviceArg, GroupArg, ShapeArg
from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import parallel
from fusible.functional.norms import (NORM_CHECKS, check_trailing, effective_gamma,
                                      layer_norm_backward, layer_norm_forward, norm_options)
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class LayerNormForwardArgs:
    input: Tensor
    weight: Tensor
    bias: Tensor
    normalized_shape: list[int]
    eps: float
    zero_centered_gamma: bool = False


@attrs.define
class LayerNormSaved:
    """LayerNorm's saved record (when any gradient is needed)."""

    input: Tensor
    mean: Tensor
    rstd: Tensor
    weight: Tensor
    bias: Tensor


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
    zero_centered_gamma: bool = False


class LayerNorm(parallel.ReplicatedParallelViews, BasicOperation):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing dimensions.

    On CUDA one Triton kernel each way; under an FP8 recipe the forward writes the next
    linear layer's input in FP8 directly.

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
    tensor_parallel_group : torch.parallel.ProcessGroup, optional
        The group of ``sequence_parallel``; the default group when None.
    zero_centered_gamma : bool
        TransformerEngine's option: multiply by ``1 + weight`` (computed in float32) and
        start ``weight`` at zeros, so that weight decay pulls towards the identity.
    recompute_output : bool
        Recompute the output in the backward instead of letting the linear layer after
        it save it (Megatron's selective recompute of the norm): the joint fusion
        :class:`~fusible.fusions.RecomputeNormLinear` then owns both passes of the norm and
        the linear layer, saving one activation of the input's size less for one more norm
        pass in the backward. Where that fusion is refused (sequence parallelism, a
        row-parallel layer, a frozen weight) the plan says why and the output is saved as
        usual.
    device, dtype
        Where and in which dtype to create ``weight`` (ones; zeros with
        ``zero_centered_gamma``) and ``bias`` (zeros).

    Notes
    -----
    Saves a :class:`LayerNormSaved` when any gradient is needed.
    """

    param_names = ("weight", "bias")
    attribute_checks = {**NORM_CHECKS,
                        "zero_centered_gamma": checks.boolean("zero_centered_gamma")}
    fwd_args_type = LayerNormForwardArgs
    bwd_args_type = LayerNormBackwardArgs
    saved_type = LayerNormSaved
    quantizes_own_output = True

    def __init__(self, normalized_shape: ShapeArg, *, eps: float = 1e-5,
                 sequence_parallel: bool = False,
                 tensor_parallel_group: GroupArg = None, zero_centered_gamma: bool = False,
                 recompute_output: bool = False, device: DeviceArg = None,
                 dtype: DTypeArg = None):
        super().__init__()
        # a tuple once set: attribute_checks converts it (an int or a sequence)
        self.normalized_shape: tuple[int, ...] = normalized_shape  # type: ignore[assignment]
        self.parallel = parallel.sequence_parallel(
            self.describe(), bool(NORM_CHECKS["sequence_parallel"](type(self).__name__,
                                                                   sequence_parallel)),
            tensor_parallel_group)
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.recompute_output = recompute_output
        start = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(start(self.normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))

    def describe(self) -> str:
        return f"LayerNorm(normalized_shape={self.normalized_shape}{norm_options(self)})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        check_trailing(self, shape, self.normalized_shape)
        self._check_param("weight", self.param("weight"), dtype, device,
                          self.normalized_shape)
        self._check_param("bias", self.param("bias"), dtype, device, self.normalized_shape)
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        weight, bias = params
        return LayerNormForwardArgs(input, weight, bias, list(self.normalized_shape), self.eps,
                                    self.zero_centered_gamma)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False, output_format=None):
        y, mean, rstd = layer_norm_forward(args.input,
                                           effective_gamma(args.weight, args.zero_centered_gamma),
                                           args.bias, args.normalized_shape, args.eps,
                                           output_format)
        return ForwardResult(y, (), (mean, rstd))

    def save_for_backward(self, args, result, ctxs):
        ctx = ctxs[0]
        if ctx.needs.any:
            ctx.saved = LayerNormSaved(args.input, *result.aux, args.weight, args.bias)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx, saved = ctxs[0], ctxs[0].saved
        return LayerNormBackwardArgs(grad_output, saved.input, saved.mean, saved.rstd,
                                     saved.weight, saved.bias, list(self.normalized_shape),
                                     ctx.needs.input, *ctx.needs.params,
                                     self.zero_centered_gamma)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        # dx in high precision: the caller quantizes it where the previous stage wants FP8
        mask = [args.need_grad_input, args.need_grad_weight, args.need_grad_bias]
        weight = args.weight
        dx, dw, db = layer_norm_backward(args.grad_output, args.input, args.mean, args.rstd,
                                         effective_gamma(weight, args.zero_centered_gamma),
                                         args.bias, args.normalized_shape, mask)
        return BackwardResult(dx, (None if dw is None else dw.to(weight.dtype), db))

    def reference(self, x, extra_inputs, params):
        gamma = 1 + params[0] if self.zero_centered_gamma else params[0]
        return F.layer_norm(x, self.normalized_shape, gamma, params[1], self.eps), ()

    @classmethod
    def example(cls):
        return Example((cls(32),), (3, 5, 32))

    def reset_parameters(self) -> None:
        """Ones (zeros with ``zero_centered_gamma``) and zeros, as the constructor makes
        them."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            self.bias.zero_()

    def extra_repr(self) -> str:
        on = "".join(f", {name}=True" for name in ("zero_centered_gamma", "recompute_output")
                     if getattr(self, name))
        return f"normalized_shape={self.normalized_shape}, eps={self.eps}{on}"
