"""Scaled gated units: a gated unit whose output row is multiplied by a per-token scale,
an extra input (a mixture of experts' router weights, applied inside the expert rather
than when the experts' outputs are combined)."""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import torch

from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.activations import scaled_glu_backward, scaled_glu_forward
from fusible.ops.glu import GEGLU, GLU, QGEGLU, GatedActivation, ReGLU, SReGLU
from fusible.ops.swiglu import ClampedOptions, SiTUOptions, SwiGLU

Tensor = torch.Tensor


@attrs.define
class ScaledGLUForwardArgs:
    input: Tensor
    scales: Tensor
    kind: str
    interleave: int
    clamp: tuple[float, ...]


@attrs.define
class ScaledGLUSaved:
    """A scaled unit's saved record: its input (both gradients read it) and the scales
    (the input gradient reads them; None where it is not needed)."""

    input: Tensor
    scales: Optional[Tensor]


@attrs.define
class ScaledGLUBackwardArgs:
    grad_output: Tensor
    input: Tensor
    scales: Optional[Tensor]
    kind: str
    interleave: int
    clamp: tuple[float, ...]
    need_grad_input: bool
    need_grad_scales: bool


class ScaledUnit:
    """The scaled form of a gated unit (mixed in before it): ``y = unit(x) * scales[...,
    None]``, ``model(x, scales)`` with ``scales`` of shape ``x.shape[:-1]`` in ``x``'s dtype;
    the scales' gradient is ``sum(dy * unit(x), -1)``. Computed in float32 for 16-bit
    inputs, rounded once: on CUDA one Triton kernel each way (the scales' gradient summed
    in the backward's walk over each row), with the FP8 cast of the output (or of the
    input gradient) fused when the next (previous) GEMM takes it in FP8; elsewhere
    PyTorch ops. Not with ``cache_quantized_input``.
    """

    num_extra_inputs = 1
    # Typed as GatedActivation's, whose records these override (mypy wants them the same)
    fwd_args_type: ClassVar[Optional[type]] = ScaledGLUForwardArgs
    bwd_args_type: ClassVar[Optional[type]] = ScaledGLUBackwardArgs
    saved_type: ClassVar[Optional[type]] = ScaledGLUSaved
    quantizes_own_output = True

    def __init__(self, **options):
        for name in ("cache_quantized_input", "recompute_output"):
            if options.get(name):
                raise ValueError(f"{type(self).__name__}: {name} is not available for "
                                 f"scaled units")
        super().__init__(**options)

    def validate(self, shape, dtype, device, extra_inputs=()):
        out = super().validate(shape, dtype, device)
        (scales,) = extra_inputs
        if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != tuple(shape[:-1]):
            got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales)
            raise ValueError(f"{self.describe()} takes one scale per row: scales of shape "
                             f"{tuple(shape[:-1])}, got {got}")
        if scales.dtype != dtype or scales.device != device:
            raise TypeError(f"{self.describe()} got scales of dtype {scales.dtype} on "
                            f"{scales.device} for an input of dtype {dtype} on {device}")
        return out

    def forward_args(self, input, params, extra_inputs, ctxs):
        return ScaledGLUForwardArgs(input, extra_inputs[0], self.kind,
                                    self.glu_interleave_size or 0, self.clamp())

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False, output_format=None):
        return ForwardResult(scaled_glu_forward(args.kind, args.input, args.scales,
                                                args.interleave, args.clamp, output_format))

    def save_for_backward(self, args, result, ctxs):
        needs = ctxs[0].needs
        if needs.any:
            ctxs[0].saved = ScaledGLUSaved(args.input, args.scales if needs.input else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs, saved = ctxs[0].needs, ctxs[0].saved
        return ScaledGLUBackwardArgs(grad_output, saved.input, saved.scales, self.kind,
                                     self.glu_interleave_size or 0, self.clamp(), needs.input,
                                     needs.extra_inputs[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        dx, ds = scaled_glu_backward(args.kind, args.grad_output, args.input, args.scales,
                                     args.need_grad_input, args.need_grad_scales,
                                     args.interleave, args.clamp, output_format)
        return BackwardResult(dx, (), (ds,))

    def reference(self, x, extra_inputs, params):
        y, _ = super().reference(x, (), params)
        return y * extra_inputs[0].unsqueeze(-1), ()

    example_options: dict = {}  # the constructor options of the test matrices' example

    @classmethod
    def example(cls):
        return Example((cls(**cls.example_options),), (3, 5, 64), ((3, 5),))


# Each scaled unit is the plain unit's gate on the scaled base, not a subclass of the plain
# unit: a fusion pattern written for SwiGLU must not match a ScaledSwiGLU (isinstance).


class ScaledSwiGLU(ScaledUnit, GatedActivation):
    """``silu(a) * b * scales[..., None]`` (see :class:`ScaledUnit`)."""

    kind = "swiglu"
    gate_reference = staticmethod(SwiGLU.gate_reference)


class ScaledClampedSwiGLU(ScaledUnit, ClampedOptions, GatedActivation):
    """GPT-OSS's clamped SwiGLU (:class:`~fusible.ops.ClampedSwiGLU`'s options) times the
    per-token scales (see :class:`ScaledUnit`)."""

    example_options = {"limit": 1.5, "glu_interleave_size": 4}  # the clamps bite


class ScaledSiTUGLU(ScaledUnit, SiTUOptions, GatedActivation):
    """SiTU-GLU (:class:`~fusible.ops.SiTUGLU`'s options) times the per-token scales (see
    :class:`ScaledUnit`)."""


class ScaledGLU(ScaledUnit, GatedActivation):
    """``sigmoid(a) * b * scales[..., None]`` (see :class:`ScaledUnit`)."""

    kind = "glu"
    gate_reference = staticmethod(GLU.gate_reference)


class ScaledGEGLU(ScaledUnit, GatedActivation):
    """``gelu_tanh(a) * b * scales[..., None]`` (see :class:`ScaledUnit`)."""

    kind = "geglu"
    gate_reference = staticmethod(GEGLU.gate_reference)


class ScaledQGEGLU(ScaledUnit, GatedActivation):
    """``a sigmoid(1.702 a) * b * scales[..., None]`` (see :class:`ScaledUnit`)."""

    kind = "qgeglu"
    gate_reference = staticmethod(QGEGLU.gate_reference)


class ScaledReGLU(ScaledUnit, GatedActivation):
    """``relu(a) * b * scales[..., None]`` (see :class:`ScaledUnit`)."""

    kind = "reglu"
    gate_reference = staticmethod(ReGLU.gate_reference)


class ScaledSReGLU(ScaledUnit, GatedActivation):
    """``relu(a)**2 * b * scales[..., None]`` (see :class:`ScaledUnit`)."""

    kind = "sreglu"
    gate_reference = staticmethod(SReGLU.gate_reference)
