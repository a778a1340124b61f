"""Reshape: ``y = x.reshape(shape)``."""

from __future__ import annotations

import math
from typing import Sequence, cast

import attrs
import torch

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class ReshapeForwardArgs:
    input: Tensor
    shape: list[int]


@attrs.define
class ReshapeSaved:
    """Reshape's saved record: the input's shape (no tensor)."""

    input_shape: list


@attrs.define
class ReshapeBackwardArgs:
    grad_output: Tensor
    input_shape: list[int]
    need_grad_input: bool


class Reshape(BasicOperation):
    """Reshape to ``shape`` (one entry may be -1), like ``torch.reshape``.

    Notes
    -----
    Saves a :class:`ReshapeSaved`: the input shape (not the input).
    """

    fwd_args_type = ReshapeForwardArgs
    bwd_args_type = ReshapeBackwardArgs
    saved_type = ReshapeSaved

    attribute_checks = {"shape": lambda op, value: _target_shape(value)}

    def __init__(self, shape: Sequence[int]):
        super().__init__()
        self.shape = shape

    def describe(self) -> str:
        return f"Reshape(shape={self.shape})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        numel = math.prod(shape)
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if known == 0 or numel % known:
                raise ValueError(f"{self.describe()} cannot reshape input of shape "
                                 f"{tuple(shape)} ({numel} elements)")
            return tuple(numel // known if s == -1 else s for s in self.shape)
        if known != numel:
            raise ValueError(f"{self.describe()} cannot reshape input of shape {tuple(shape)} "
                             f"({numel} elements) to {known} elements")
        return self.shape

    def forward_args(self, input, params, extra_inputs, ctxs):
        return ReshapeForwardArgs(input, list(self.shape))

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input.reshape(args.shape))

    def save_for_backward(self, args, result, ctxs):
        if ctxs[0].needs.input:
            ctxs[0].saved = ReshapeSaved(list(args.input.shape))

    def inline_when_compiled(self, direction):
        return True  # views of x and dy: no copy when compiled

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        saved = ctxs[0].saved
        return ReshapeBackwardArgs(grad_output, saved.input_shape if saved else [],
                                   ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(args.grad_output.reshape(args.input_shape))

    def reference(self, x, extra_inputs, params):
        return x.reshape(self.shape), ()

    @classmethod
    def example(cls):
        return Example((cls((-1, 4, 8)),), (3, 64))

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


def _target_shape(value) -> tuple:
    # int_tuple stores a tuple (a Check returns object)
    shape = cast(tuple, checks.int_tuple("shape", minimum=-1)("Reshape", value))
    if sum(s == -1 for s in shape) > 1:
        raise ValueError(f"Reshape: shape may hold one -1, got shape={shape}")
    return shape
