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
from fusible.planning.features.channels import channel_of, write_channel_of

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


def reference_copy(t: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """``t`` for a reference run: a floating tensor detached, in ``dtype``, requiring grad
    where ``t`` does; any other (integer split sizes) detached as it is."""
    if not t.is_floating_point():
        return t.detach()
    return t.detach().to(dtype).requires_grad_(t.requires_grad)


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


class _QuantizedValue(torch.autograd.Function):
    """The value through ``fn`` (an emulated quantize-dequantize); gradient as is."""

    @staticmethod
    def forward(ctx, t, fn):
        return fn(t)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _QuantizedGrad(torch.autograd.Function):
    """The value as is; its gradient through ``fn``."""

    @staticmethod
    def forward(ctx, t, fn):
        ctx.fn = fn
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad), None


@attrs.frozen
class FP8Emulation:
    """How a reference emulates an FP8 ``recipe``: ``forward(t)`` and ``grad(t)`` return
    ``t`` quantized (in the recipe's forward and gradient formats) and dequantized, in
    ``t``'s dtype. Written by the test, from the formats' definitions, so that the
    library's own FP8 constants and casts are checked rather than reused.

    The reference applies ``forward`` to the input and the quantized parameters
    (``quantized_params``) of every op that has some, and ``grad`` to the gradient of its
    output: the operands of an FP8 linear layer's three GEMMs. Other ops that quantize
    under the recipe (``quantizes(recipe, direction)``, e.g. Quantize) get ``forward``
    on their output and ``grad`` on the gradient they send back.
    """

    recipe: object
    forward: Callable
    grad: Callable


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
        before = {min(s.indices) for s in plan.backward}
        for s in plan.backward:  # where a fused stage also rounds inside (declared)
            for name in getattr(s.op, "rounds_gradient_before", ()):
                op = s.op.match[name]
                before.add(next(i for i, o in zip(s.op.match.indices, s.op.match.ops)
                                if o is op))
        after = {max(s.indices) for s in plan.forward}
        for s in plan.forward:
            for name in getattr(s.op, "rounds_output_after", ()):
                op = s.op.match[name]
                after.add(next(i for i, o in zip(s.op.match.indices, s.op.match.ops)
                               if o is op))
        return cls(low, frozenset(after), frozenset(before))


def reference_forward(model, x, *extra_inputs, dtype=torch.float64,
                      rounding: Rounding | None = None, fp8: FP8Emulation | None = None):
    """Run ``model`` op by op with plain PyTorch in ``dtype``; with ``rounding``, round
    values and gradients where the pipeline's stages do (see :class:`Rounding`); with
    ``fp8``, quantize the GEMM operands as an FP8 recipe does (see :class:`FP8Emulation`).

    Returns ``(outputs, params)``: outputs as the model would return them and
    a dict mapping each original parameter (by id) to its differentiable copy.
    """
    params: dict = {}

    def copy_of(p):
        if id(p) not in params:
            params[id(p)] = p.detach().to(dtype).requires_grad_(p.requires_grad)
        return params[id(p)]

    extras, extra_outputs = list(extra_inputs), []
    channels: dict[str, torch.Tensor] = {}  # a named channel's tensor, for its readers
    if rounding is not None:
        extras = [_RoundGrad.apply(e, rounding.low) if e.is_floating_point() else e
                  for e in extras]
    for index, item in enumerate(model.pipeline()):
        if rounding is not None and index in rounding.before:
            x = _RoundGrad.apply(x, rounding.low)
        if isinstance(item, BasicOperationSpec):
            k, read, write = item.num_extra_inputs, channel_of(item), write_channel_of(item)
            op_params = [copy_of(p) for p in item.fusible_params()]
            gemm = fp8 is not None and bool(item.quantized_params)
            if gemm:
                assert fp8 is not None  # (gemm says so)
                x = _QuantizedValue.apply(x, fp8.forward)
                op_params = [_QuantizedValue.apply(p, fp8.forward) if name in
                             item.quantized_params else p
                             for name, p in zip(item.param_names, op_params)]
            elif fp8 is not None and item.quantizes(fp8.recipe, "backward"):
                x = _QuantizedGrad.apply(x, fp8.grad)
            taken = [channels[read]] * k if read and k else extras[:k]
            if not read:
                extras = extras[k:]
            x, outs = op_reference(item, x, taken, op_params)
            if gemm:
                assert fp8 is not None
                x = _QuantizedGrad.apply(x, fp8.grad)
            elif fp8 is not None and item.quantizes(fp8.recipe, "forward"):
                x = _QuantizedValue.apply(x, fp8.forward)
            if write and outs:  # a named channel: for the readers after it
                channels[write] = outs[0]
            else:
                extra_outputs += outs
        else:  # an ordinary module: run it on float64 copies of its parameters and buffers
            state = {name: copy_of(p) for name, p in item.named_parameters()}
            state.update({name: b.to(dtype) if b.is_floating_point() else b
                          for name, b in item.named_buffers()})
            x = torch.func.functional_call(item, state, (x,))
        if rounding is not None and index in rounding.after:
            x = _RoundValue.apply(x, rounding.low)
    return ((x, *extra_outputs) if extra_outputs else x), params
