"""The gated linear units: ``a, b = x.chunk(2, -1); y = gate(a) * b``.

SwiGLU (``fusible.ops.swiglu``) and, here, GLU, GEGLU, QGEGLU, ReGLU and SReGLU, as
TransformerEngine defines them: the gate acts on the first half (PyTorch's ``F.glu``
gates the second). One base class; each unit names its gate (a key of
``fusible.functional.activations.GATES``).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.nn.functional as F

from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.activations import glu_backward, glu_forward
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class GLUForwardArgs:
    input: Tensor
    kind: str


@attrs.define
class GLUBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    kind: str
    need_grad_input: bool


@attrs.define
class GLUSaved:
    """A gated unit's saved record: its input, when the input needs a gradient."""

    input: Optional[Tensor]


class GatedActivation(BasicOperation, abstract=True):
    """Base of the gated linear units: the last dimension halves, ``gate(a) * b``.

    Computes in float32 for 16-bit inputs; on CUDA one Triton kernel each way, which under
    an FP8 recipe writes the next linear layer's input (or the previous one's gradient) in
    FP8 directly.

    Notes
    -----
    Saves a :class:`GLUSaved`: its input when the input needs a gradient.
    """

    kind: str = ""  # a key of fusible.functional.activations.GATES
    fwd_args_type = GLUForwardArgs
    bwd_args_type = GLUBackwardArgs
    saved_type = GLUSaved
    quantizes_own_output = True

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape or shape[-1] % 2:
            raise ValueError(f"{type(self).__name__} needs an even last dimension, got input "
                             f"shape {tuple(shape)}")
        return (*shape[:-1], shape[-1] // 2)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return GLUForwardArgs(input, self.kind)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False, output_format=None):
        return ForwardResult(glu_forward(args.kind, args.input, output_format))

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = GLUSaved(args.input if ctxs[0].needs.input else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return GLUBackwardArgs(grad_output, ctxs[0].saved.input, self.kind, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(glu_backward(args.kind, args.grad_output, args.input,
                                           output_format))

    def reference(self, x, extra_inputs, params):
        a, b = x.chunk(2, -1)
        return self.gate_reference(a) * b, ()

    @staticmethod
    def gate_reference(a):
        raise NotImplementedError

    @classmethod
    def example(cls):
        return Example((cls(),), (3, 5, 64))


class GLU(GatedActivation):
    """``sigmoid(a) * b``."""

    kind = "glu"
    gate_reference = staticmethod(torch.sigmoid)


class GEGLU(GatedActivation):
    """``gelu(a) * b``, GELU's tanh approximation (TransformerEngine's)."""

    kind = "geglu"

    @staticmethod
    def gate_reference(a):
        return F.gelu(a, approximate="tanh")


class QGEGLU(GatedActivation):
    """``a * sigmoid(1.702 a) * b`` (quick GELU)."""

    kind = "qgeglu"

    @staticmethod
    def gate_reference(a):
        return a * torch.sigmoid(1.702 * a)


class ReGLU(GatedActivation):
    """``relu(a) * b``."""

    kind = "reglu"
    gate_reference = staticmethod(torch.relu)


class SReGLU(GatedActivation):
    """``relu(a)**2 * b``."""

    kind = "sreglu"

    @staticmethod
    def gate_reference(a):
        return torch.relu(a).square()
