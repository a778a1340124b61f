"""The gated linear units: ``a, b = x.chunk(2, -1); y = gate(a) * b``.

SwiGLU and ClampedSwiGLU (``fusible.ops.swiglu``) and, here, GLU, GEGLU, QGEGLU, ReGLU
and SReGLU, as TransformerEngine defines them: the gate acts on the first half (PyTorch's
``F.glu`` gates the second). One base class; each unit names its gate (a key of
``fusible.functional.activations.GATES``), and takes TransformerEngine's options
(``glu_interleave_size``, ``cache_quantized_input``).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import torch
import torch.nn.functional as F

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.activations import glu_backward, glu_forward
from fusible.kernels.swiglu import CLAMP_DEFAULTS
from fusible.module import BasicOperation
from fusible.quantization.casts.dequantize import dequantize
from fusible.quantization.casts.tensorwise import cast_tensorwise

__all__ = ["GatedActivation"]

Tensor = torch.Tensor


@attrs.define
class GLUForwardArgs:
    input: Tensor
    kind: str
    interleave: int  # 0: the halves one after the other
    clamp: tuple[float, ...]  # the clamped kind's (limit, alpha, offset)
    cache_quantized: bool


@attrs.define
class GLUBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    input_fp8: Optional[Tensor]  # with cache_quantized_input: the FP8 data and its scale
    input_scale_inv: Optional[Tensor]
    kind: str
    interleave: int
    clamp: tuple[float, ...]
    need_grad_input: bool


@attrs.define
class GLUSaved:
    """A gated unit's saved record, when the input needs a gradient: its input, or with
    ``cache_quantized_input`` its E4M3 data and inverse scale."""

    input: Optional[Tensor]
    input_fp8: Optional[Tensor] = None
    input_scale_inv: Optional[Tensor] = None


class GatedActivation(BasicOperation, abstract=True):
    """Base of the gated linear units: the last dimension halves, ``gate(a) * b``.

    Computes in float32 for 16-bit inputs; on CUDA one Triton kernel each way, which under
    an FP8 recipe writes the next linear layer's input (or the previous one's gradient) in
    FP8 directly.

    Parameters
    ----------
    glu_interleave_size : int, optional
        The halves alternate in blocks of this many features (``[a_1..a_s, b_1..b_s,
        a_s+1..]``) instead of standing one after the other; TransformerEngine's option.
        What a gated unit after a column-parallel layer needs, so that each rank's slice
        of the features holds whole pairs (the plan refuses the plain layout there).
    cache_quantized_input : bool
        Save the input for the backward in FP8 (E4M3, a current per-tensor scale) rather
        than in its own dtype: half the memory of a 16-bit input, at the cost of a cast
        and of the backward computing from the quantized values.
    recompute_output : bool
        Where a linear layer reads the unit's output (a feed-forward block's down
        projection), do not save that output for its weight gradient: the backward
        recomputes it, bit for bit, in the pass that computes the unit's gradient (the
        joint fusion ``RecomputeGluLinear``, in high precision). One activation less
        between the passes (``tokens x ffn``, the largest a feed-forward block saves
        after its input) for one more write in the backward; what torch.compile's
        partitioner and Liger-Kernel's SwiGLU do.

    Notes
    -----
    Saves a :class:`GLUSaved`: its input (or its FP8 copy) when the input needs a
    gradient.
    """

    kind: str = ""  # a key of fusible.functional.activations.GATES
    # Typed as StageSpec's, not as these records: the scaled units (ops.scaled_glu) swap them
    fwd_args_type: ClassVar[Optional[type]] = GLUForwardArgs
    bwd_args_type: ClassVar[Optional[type]] = GLUBackwardArgs
    saved_type: ClassVar[Optional[type]] = GLUSaved
    quantizes_own_output = True
    attribute_checks = {
        "glu_interleave_size": checks.optional(checks.positive_int("glu_interleave_size")),
        "cache_quantized_input": checks.boolean("cache_quantized_input"),
        "recompute_output": checks.boolean("recompute_output"),
    }

    def __init__(self, *, glu_interleave_size: Optional[int] = None,
                 cache_quantized_input: bool = False, recompute_output: bool = False):
        super().__init__()
        self.glu_interleave_size = glu_interleave_size
        self.cache_quantized_input = cache_quantized_input
        self.recompute_output = recompute_output

    def describe(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self) -> str:
        options = [f"{name}={value!r}" for name, value in self.options()]
        if self.glu_interleave_size is not None:
            options.append(f"glu_interleave_size={self.glu_interleave_size}")
        options += [f"{name}=True" for name in ("cache_quantized_input", "recompute_output")
                    if getattr(self, name)]
        return ", ".join(options)

    def options(self) -> tuple:
        """``(name, value)`` of the unit's own constructor options, for its label."""
        return ()

    def clamp(self) -> tuple:
        """The clamped kind's ``(limit, alpha, offset)``; the defaults elsewhere (unread)."""
        return CLAMP_DEFAULTS

    def check_split_features(self, producer, world_size):
        if self.glu_interleave_size is None:
            raise ValueError(
                f"{self.describe()} after the column-parallel {producer}: each of the "
                f"{world_size} ranks holds a contiguous slice of the features, which "
                f"x.chunk(2, -1) would split into halves that do not pair up. Lay the "
                f"layer's output features out interleaved (fusible.interleave_glu_rows on "
                f"its weight and bias) and construct the unit with glu_interleave_size "
                f"(a divisor of half of each rank's slice)")

    def validate(self, shape, dtype, device, extra_inputs=()):
        width = 2 * (self.glu_interleave_size or 1)
        if not shape or shape[-1] % width:
            what = (f"a last dimension divisible by 2 * glu_interleave_size = {width}"
                    if self.glu_interleave_size else "an even last dimension")
            raise ValueError(f"{self.describe()} needs {what}, got input shape "
                             f"{tuple(shape)}")
        return (*shape[:-1], shape[-1] // 2)

    def forward_args(self, input, params, extra_inputs, ctxs):
        cache = self.cache_quantized_input and ctxs[0].needs.input
        return GLUForwardArgs(input, self.kind, self.glu_interleave_size or 0, self.clamp(),
                              cache)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False, output_format=None):
        y = glu_forward(args.kind, args.input, output_format, args.interleave, args.clamp)
        if not args.cache_quantized:
            return ForwardResult(y)
        data, scale_inv = cast_tensorwise(args.input, torch.float8_e4m3fn, False)
        return ForwardResult(y, (), (data, scale_inv))

    def save_for_backward(self, args, result, ctxs):
        if not ctxs[0].needs.input:
            ctxs[0].saved = GLUSaved(None)
        elif args.cache_quantized:
            ctxs[0].saved = GLUSaved(None, *result.aux)
        else:
            ctxs[0].saved = GLUSaved(args.input)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        saved = ctxs[0].saved
        return GLUBackwardArgs(grad_output, saved.input, saved.input_fp8, saved.input_scale_inv,
                               self.kind, self.glu_interleave_size or 0, self.clamp(),
                               ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False, output_format=None):
        if not args.need_grad_input:
            return BackwardResult(None)
        x = args.input
        if x is None:  # cached in FP8; the output gradient has the input's dtype
            x = dequantize(args.input_fp8, args.input_scale_inv, args.grad_output.dtype)
        return BackwardResult(glu_backward(args.kind, args.grad_output, x, output_format,
                                           args.interleave, args.clamp))

    def reference(self, x, extra_inputs, params):
        s = self.glu_interleave_size
        if s:  # [a_1..a_s, b_1..b_s, ...] -> [a | b]
            x = x.reshape(-1, x.shape[-1] // (2 * s), 2, s).transpose(1, 2).reshape(x.shape)
        a, b = x.chunk(2, -1)
        return self.unit_reference(a, b), ()

    def unit_reference(self, a, b):
        """The unit's value from the halves, in PyTorch ops (the FP64 reference):
        ``gate(a) * b``."""
        return self.gate_reference(a) * b

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
