"""Dropout: in training, zero each value with probability ``p`` and scale the rest by
``1 / (1 - p)``; in evaluation, the identity (TransformerEngine's ``ops.Dropout``)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class DropoutForwardArgs:
    input: Tensor
    p: float
    training: bool


@attrs.define
class DropoutSaved:
    """The mask of kept values (bool), when the input needs a gradient."""

    mask: Optional[Tensor]


@attrs.define
class DropoutBackwardArgs:
    grad_output: Tensor
    mask: Optional[Tensor]
    p: float
    need_grad_input: bool


def keep_mask(x: Tensor, p: float) -> Tensor:
    """Which values to keep: ``rand >= p``, drawn in float32 from the global generator of
    ``x``'s device whatever ``x``'s dtype (so a seed gives the same mask in every dtype,
    eagerly and inside the compiled graph's custom op alike)."""
    return torch.rand(x.shape, device=x.device, dtype=torch.float32) >= p


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


class Dropout(BasicOperation):
    """Randomly zero values with probability ``p`` in training, scaling the kept ones by
    ``1 / (1 - p)``; the identity in evaluation (``model.eval()``).

    The mask comes from the global random generator of the input's device, inside the
    stage (its custom op when compiled), so ``torch.manual_seed`` makes it reproducible
    and the same eagerly and compiled. The backward multiplies by the same mask.

    Parameters
    ----------
    p : float
        The probability of zeroing a value, in ``[0, 1]``.

    Notes
    -----
    Saves a :class:`DropoutSaved` (one byte per value) in training when the input needs a
    gradient.
    """

    keeps_features = True

    fwd_args_type = DropoutForwardArgs
    bwd_args_type = DropoutBackwardArgs
    saved_type = DropoutSaved
    attribute_checks = {"p": checks.real("p", minimum=0.0)}

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"Dropout(p={p}): p must be in [0, 1]")
        self.p = p

    def describe(self) -> str:
        return f"Dropout(p={self.p})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        if self.p > 1.0:
            raise ValueError(f"{self.describe()}: p must be in [0, 1]")
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return DropoutForwardArgs(input, float(self.p), self.training)

    def left_out_of_plans(self):
        # The identity in training too (evaluation is not a configuration), drawing nothing,
        # as torch.nn.Dropout(0) does; a subclass may do more
        return type(self) is Dropout and self.p == 0.0

    def _identity(self) -> bool:
        return not self.training or self.p == 0.0

    def inline_when_compiled(self, direction):
        return self._identity()  # x and dy handed on as they are: no copy when compiled

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x = args.input
        if not args.training or args.p == 0.0:
            return ForwardResult(x)
        mask = keep_mask(x, args.p)
        return ForwardResult(x * mask * _scale(args.p), (), (mask,))

    def save_for_backward(self, args, result, ctxs):
        ctx = ctxs[0]
        if ctx.needs.input and result.aux:
            ctx.saved = DropoutSaved(result.aux[0])

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        ctx = ctxs[0]
        mask = ctx.saved.mask if ctx.saved is not None else None
        return DropoutBackwardArgs(grad_output, mask, float(self.p), ctx.needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        if args.mask is None:  # the identity (evaluation, or p = 0)
            return BackwardResult(args.grad_output)
        return BackwardResult(args.grad_output * args.mask * _scale(args.p))

    def reference(self, x, extra_inputs, params):
        if self.training and self.p > 0.0:
            raise NotImplementedError(f"{self.describe()} in training draws a random mask: "
                                      f"no deterministic reference")
        return x, ()

    @classmethod
    def example(cls):
        return Example((cls(0.0),), (5, 32))

    def extra_repr(self) -> str:
        return f"p={self.p}"
