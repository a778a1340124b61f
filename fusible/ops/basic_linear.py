"""BasicLinear: ``y = x @ weight.T`` over any number of leading dimensions."""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch
from torch import nn

from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult
from fusible.ops.linear_math import (as_fp8, gemm_backward, gemm_forward, handed_in_fp8,  # noqa: F401
                                     like_tokens, linear_dgrad, linear_forward, linear_wgrad,
                                     tokens_2d, transposed_only)
from fusible.quantization.float8_tensor import Fp8Able, quantize_raw

Tensor = torch.Tensor


@attrs.define
class LinearForwardArgs:
    input: Fp8Able
    weight: Tensor
    fp8_dtype: Optional[torch.dtype]  # None: high precision
    keep_input_t: bool                # FP8: keep the input's transposed copy (for wgrad)


@attrs.define
class LinearBackwardArgs:
    grad_output: Fp8Able
    input: Optional[Fp8Able]
    weight: Optional[Fp8Able]
    grad_fp8_dtype: Optional[torch.dtype]  # None: high precision
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
    fp8_input_consumer = fp8_grad_consumer = True
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

    def validate_fp8(self, shape) -> None:
        """FP8 GEMMs (Hopper's) need every dimension divisible by 16."""
        tokens = math.prod(shape[:-1])
        if self.in_features % 16 or self.out_features % 16 or tokens % 16:
            raise ValueError(f"{self.describe()} under an FP8 recipe needs in_features, "
                             f"out_features and the number of tokens divisible by 16, got "
                             f"{tokens} tokens; pad the tokens or run it outside "
                             f"fusible.autocast")

    def forward_args(self, input, params, extra_inputs, ctxs):
        return LinearForwardArgs(input, params[0], *fp8_forward_flags(ctxs[0]))

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        y, x_q = gemm_forward(args.input, args.weight, None, args.fp8_dtype, args.keep_input_t)
        return ForwardResult(y, (), linear_aux(args, x_q))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args, result.aux)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return linear_backward_args(ctxs[0], grad_output)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(*linear_backward(args))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def fp8_forward_flags(ctx) -> tuple:
    """``(fp8_dtype, keep_input_t)`` of a BasicLinear's forward args."""
    recipe = ctx.recipe
    if recipe is None:
        return None, False
    return recipe.forward_dtype, ctx.needs.params[0]


def save_linear(ctx, args, aux: tuple) -> None:
    """BasicLinear's saved layout ``(input, weight)``: the input for wgrad, the weight for
    dgrad. Under FP8 the input is kept as its transposed FP8 copy only (all wgrad reads),
    from the forward result's aux (see :func:`linear_aux`); the weight is kept as the
    parameter itself and quantized again in the backward (see :func:`linear_saved`)."""
    x = args.input
    if args.fp8_dtype is not None:
        if handed_in_fp8(args.input, args.fp8_dtype):
            x_q = as_fp8(args.input, args.fp8_dtype, args.keep_input_t)
            x_t, x_scale_inv = x_q._transpose, x_q._scale_inv
        else:
            x_t, x_scale_inv = aux[:2]
        x = transposed_only(x_t, x_scale_inv, args.input.dtype) if args.keep_input_t else None
    ctx.saved = (x if ctx.needs.params[0] else None, args.weight if ctx.needs.input else None)


def linear_aux(args, x_q) -> tuple:
    """The aux tensors a forward GEMM stage returns under FP8: the input's transposed copy
    and scale, ``(x_t, x_scale_inv)`` (None where not kept). An input that arrived in FP8
    is the caller's to save (see :func:`handed_in_fp8`)."""
    if args.fp8_dtype is None or handed_in_fp8(args.input, args.fp8_dtype):
        return ()
    return (x_q._transpose, x_q._scale_inv)


def linear_saved(ctx) -> tuple:
    """``(input, weight, grad_fp8_dtype)`` for a BasicLinear's backward GEMMs.

    Under FP8 the weight is quantized again, with its transposed copy for dgrad: the
    same bits as in the forward (current scaling of an unchanged parameter; autograd
    checks its version), and no FP8 copy of every weight held between the passes.
    """
    x, weight = ctx.saved
    if ctx.recipe is None:
        return x, weight, None
    if weight is not None:
        w_q = quantize_raw(weight, ctx.recipe.forward_dtype, columnwise=True)
        weight = transposed_only(w_q._transpose, w_q._scale_inv, weight.dtype)
    return x, weight, ctx.recipe.backward_dtype


def linear_backward_args(ctx, grad_output) -> LinearBackwardArgs:
    x, weight, grad_dtype = linear_saved(ctx)
    return LinearBackwardArgs(grad_output, x, weight, grad_dtype, ctx.needs.input,
                              ctx.needs.params[0])


def linear_backward(args, accumulate_into=None) -> tuple:
    """(dgrad or None, (wgrad or None,)) for LinearBackwardArgs-like args."""
    dx, dw = gemm_backward(args.grad_output, args.input, args.weight, args.grad_fp8_dtype,
                           args.need_grad_input, args.need_grad_weight, accumulate_into)
    return dx, (dw,)
