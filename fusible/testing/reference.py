"""FP64 references: exactly representable tensors and a plain-PyTorch run of a pipeline.

:func:`reference_forward` runs any Sequential op by op with each op's own
``reference()`` (or one registered with :func:`register_reference`, for ops that do
not define it) in float64, so that the result can be compared with the fused run.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch
from torch import nn

from fusible.core.operation import BasicOperationSpec

_REFERENCES: dict = {}


def register_reference(op_type: type) -> Callable:
    """Decorator registering ``fn(op, x, extra_inputs, params) -> (y, extra_outputs)`` as
    the FP64 reference of ``op_type`` (for ops that do not define ``reference()``).

    ``params`` are float64 copies of ``op.fusible_params()``, in that order.
    """
    def decorator(fn):
        _REFERENCES[op_type] = fn
        return fn
    return decorator


def op_reference(op, x, extra_inputs, params):
    """``(y, extra_outputs)`` of ``op`` in plain PyTorch: a registered reference, else the
    op's own ``reference()``."""
    fn = _REFERENCES.get(op.__class__)
    if fn is not None:
        return fn(op, x, extra_inputs, params)
    return op.reference(x, tuple(extra_inputs), tuple(params))


def exact_tensor(shape, dtype=torch.float32, *, device="cpu", bits: int = 3,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Random multiples of ``2**-bits`` in [-1, 1]: exact in every float dtype."""
    scale = 2 ** bits
    k = torch.randint(-scale, scale + 1, tuple(shape), generator=generator)
    return (k.to(torch.float64) / scale).to(device=device, dtype=dtype)


def exact_parameters_(model: nn.Module, bits: int = 3, generator=None) -> nn.Module:
    """Overwrite every parameter with :func:`exact_tensor` values, in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(exact_tensor(p.shape, p.dtype, device=p.device, bits=bits,
                                 generator=generator))
    return model


class _RoundValue(torch.autograd.Function):
    """The value rounded to a low dtype (as a stage writes its output); gradient as is."""

    @staticmethod
    def forward(ctx, t, low):
        return t.to(low).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _RoundGrad(torch.autograd.Function):
    """The value as is; its gradient rounded to a low dtype (as a backward stage writes it)."""

    @staticmethod
    def forward(ctx, t, low):
        ctx.low = low
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.low).to(grad.dtype), None


@attrs.frozen
class Rounding:
    """Where the pipeline under test rounds to its dtype ``low``: the outputs of its forward
    stages (``after``: the index of each stage's last op) and the input gradients of its
    backward stages (``before``: the index of each stage's first op). A reference rounded
    there computes each stage in high precision and rounds it once, as a correct stage
    does."""

    low: torch.dtype
    after: frozenset
    before: frozenset

    @classmethod
    def of_plan(cls, plan, low: torch.dtype) -> "Rounding":
        return cls(low, frozenset(max(s.indices) for s in plan.forward),
                   frozenset(min(s.indices) for s in plan.backward))


def reference_forward(model, x, *extra_inputs, dtype=torch.float64,
                      rounding: Rounding | None = None):
    """Run ``model`` op by op with plain PyTorch in ``dtype``; with ``rounding``, round
    values and gradients where the pipeline's stages do (see :class:`Rounding`).

    Returns ``(outputs, params)``: outputs as the model would return them and
    a dict mapping each original parameter (by id) to its differentiable copy.
    """
    params: dict = {}

    def copy_of(p):
        if id(p) not in params:
            params[id(p)] = p.detach().to(dtype).requires_grad_(p.requires_grad)
        return params[id(p)]

    extras, extra_outputs = list(extra_inputs), []
    if rounding is not None:
        extras = [_RoundGrad.apply(e, rounding.low) for e in extras]
    for index, item in enumerate(model.pipeline()):
        if rounding is not None and index in rounding.before:
            x = _RoundGrad.apply(x, rounding.low)
        if isinstance(item, BasicOperationSpec):
            k = item.num_extra_inputs
            x, outs = op_reference(item, x, extras[:k], [copy_of(p) for p in item.fusible_params()])
            extras = extras[k:]
            extra_outputs += outs
        else:  # an ordinary module: run it on float64 copies of its parameters and buffers
            state = {name: copy_of(p) for name, p in item.named_parameters()}
            state.update({name: b.to(dtype) if b.is_floating_point() else b
                          for name, b in item.named_buffers()})
            x = torch.func.functional_call(item, state, (x,))
        if rounding is not None and index in rounding.after:
            x = _RoundValue.apply(x, rounding.low)
    return ((x, *extra_outputs) if extra_outputs else x), params
