"""Activation arithmetic shared by the activation ops and the fusions with one inside."""

from __future__ import annotations

from typing import Optional, TypedDict

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from fusible.functional.linear import bias_grad
from fusible.kernels import activation_cast
from fusible.kernels import dact_dbias as kernels
from fusible.kernels import scaled_glu as scaled_kernels
from fusible.kernels import swiglu as swiglu_kernels
from fusible.kernels.swiglu import CLAMP_DEFAULTS
from fusible.kernels import triton_can_run, triton_imports
from fusible.quantization.format import Float8Format
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.tensor.quantize import from_cast_parts

# What fusion authors import (docs/writing_a_fusion.md, "Helpers for fusion authors"); the
# rest serves the activation and gated-unit ops.
__all__ = ["dact_dbias", "glu_forward", "glu_backward_with_output"]

Tensor = torch.Tensor
aten = torch.ops.aten


def _in_float32(fn):
    """``fn`` computed in float32 for 16-bit tensors, rounded once to the first one's dtype
    (for compositions of several PyTorch ops, which would round after each)."""
    def run(*tensors):
        dtype = tensors[0].dtype
        cdt = compute_dtype(dtype)
        return fn(*(t.to(cdt) for t in tensors)).to(dtype)
    return run


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _qgelu_grad(dy, x):
    s = torch.sigmoid(1.702 * x)
    return dy * (s + 1.702 * x * s * (1 - s))


# kind -> (forward, backward(dy, saved), saves_output); rules as data.
ACTIVATIONS = {
    "gelu": (lambda x: F.gelu(x), lambda dy, x: aten.gelu_backward(dy, x), False),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda dy, x: aten.gelu_backward(dy, x, approximate="tanh"), False),
    "relu": (torch.relu, lambda dy, y: aten.threshold_backward(dy, y, 0), True),
    "silu": (F.silu, lambda dy, x: aten.silu_backward(dy, x), False),
    "qgelu": (_in_float32(_qgelu), _in_float32(_qgelu_grad), False),  # x * sigmoid(1.702 x)
    "srelu": (_in_float32(lambda x: torch.relu(x).square()),       # relu(x)**2
              _in_float32(lambda dy, x: dy * 2 * torch.relu(x)), False),
}

# Gated (GLU-family) kind -> (gate(a), backward(d gate, a)): ``a, b = x.chunk(2, -1)``,
# ``y = gate(a) * b``, the gate on the first half as in TransformerEngine (PyTorch's
# ``F.glu`` gates the second half). Computed in float32 for 16-bit inputs.
GATES = {
    "swiglu": (F.silu, lambda g, a: aten.silu_backward(g, a)),
    "geglu": (lambda a: F.gelu(a, approximate="tanh"),
              lambda g, a: aten.gelu_backward(g, a, approximate="tanh")),
    # sigmoid' = sigmoid(a) sigmoid(-a): (1 - sigmoid(a)) would cancel for large a
    "glu": (torch.sigmoid, lambda g, a: g * torch.sigmoid(a) * torch.sigmoid(-a)),
    "reglu": (torch.relu, lambda g, a: aten.threshold_backward(g, a, 0)),
    "sreglu": (lambda a: torch.relu(a).square(), lambda g, a: g * 2 * torch.relu(a)),
    "qgeglu": (_qgelu, _qgelu_grad),
}


def activation_forward(kind: str, x: Tensor, output_format: Optional[Float8Format] = None):
    """Apply the pointwise activation ``kind``.

    With ``output_format``, on CUDA, for the activations whose backward reads their
    input, the result comes as that Float8Tensor from Triton kernels that never write it
    in high precision. Otherwise a high-precision result (the caller quantizes it).
    """
    if output_format is not None and kind in activation_cast.KINDS and x.numel() \
            and triton_can_run(x):
        return from_cast_parts(activation_cast.activation_fp8_triton(
            kind, x, *output_format.cast_args()), x.dtype)
    return ACTIVATIONS[kind][0](x)


def activation_backward(kind: str, grad_output: Tensor, saved: Tensor) -> Tensor:
    """Gradient of the activation ``kind`` from its saved input (or output, for ReLU)."""
    return ACTIVATIONS[kind][1](grad_output, saved)


def saves_output(kind: str) -> bool:
    """Whether the activation's backward reads its output (ReLU) rather than its input."""
    return ACTIVATIONS[kind][2]


def dact_dbias(kind: str, grad_output: Tensor, saved: Tensor,
               output_format: Optional[Float8Format] = None):
    """A pointwise activation's input gradient and the gradient of the bias before it.

    On CUDA, from ``kernels.TRITON_MIN_NUMEL`` elements, one Triton kernel; elsewhere the
    PyTorch ops.

    Parameters
    ----------
    kind : str
        The activation (``op.kind``: a key of :data:`ACTIVATIONS`).
    grad_output : Tensor
        The activation output's gradient.
    saved : Tensor
        The tensor the activation saved (its input, or its output for ReLU:
        :class:`~fusible.ops.pointwise_activation.ActivationSaved`).
    output_format : Float8Format, optional
        On CUDA, ``dact`` comes as that Float8Tensor, never written in high precision;
        elsewhere ``dact`` comes in high precision (the caller quantizes it).

    Returns
    -------
    tuple
        ``(dact, dbias)``.
    """
    if (kind in kernels.KINDS and grad_output.is_cuda
            and grad_output.numel() >= kernels.TRITON_MIN_NUMEL
            and not isinstance(grad_output, FakeTensor)  # fake kernels: no launch
            and triton_imports()):
        if output_format is not None:
            data, scale_inv, transpose, dbias = kernels.dact_dbias_fp8_triton(
                kind, grad_output, saved, *output_format.cast_args())
            return Float8Tensor(data, scale_inv, grad_output.dtype, transpose), dbias
        return kernels.dact_dbias_triton(kind, grad_output, saved)
    return dact_dbias_torch(kind, grad_output, saved)


def dact_dbias_torch(kind: str, grad_output: Tensor, saved: Tensor):
    """The plain-PyTorch version: activation backward, then a sum over tokens."""
    dact = activation_backward(kind, grad_output, saved)
    return dact, bias_grad(dact)


class _Layout(TypedDict):
    """The gated units' kernels' layout keywords (a TypedDict: the splat stays checked)."""

    kind: str
    interleave: int
    clamp: tuple


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit dtypes, else the dtype itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def glu_forward(kind: str, x: Tensor, output_format: Optional[Float8Format] = None,
                interleave: int = 0, clamp: tuple = CLAMP_DEFAULTS):
    """``a, b = x.chunk(2, -1); gate(a) * b`` for the gated kind (a key of :data:`GATES`,
    ``"clamped_swiglu"`` or ``"situ_glu"``), in float32 for 16-bit inputs.

    ``interleave``: the halves alternate in blocks of that many features instead (0: they
    do not). ``clamp``: the clamped SwiGLU's ``(limit, alpha, offset)``:
    ``a' = min(a, limit)``, ``b' = clamp(b, -limit, limit)``,
    ``y = a' sigmoid(alpha a') (b' + offset)``; SiTU-GLU's ``(s, l, offset)``:
    ``y = s tanh(a/s) sigmoid(a) (l tanh(b/l) + offset)`` (``l = 0``: ``b + offset``).

    On CUDA one Triton kernel; with ``output_format`` the result comes as that
    Float8Tensor, never written in high precision. Elsewhere the PyTorch ops, and a
    high-precision result (the caller quantizes it).

    Parameters
    ----------
    kind : str
        The unit (``op.kind`` of a :class:`~fusible.ops.glu.GatedActivation`).
    x : Tensor
        ``[a | b]`` (or interleaved), the last dimension even.
    output_format : Float8Format, optional
        On CUDA, the result's FP8 format.
    interleave, clamp
        ``op.glu_interleave_size or 0`` and ``op.clamp()``.

    Returns
    -------
    Tensor
        ``x.shape[:-1] + (x.shape[-1] // 2,)``, in ``x``'s dtype (or the Float8Tensor).
    """
    if triton_can_run(x):
        layout = _Layout(kind=kind, interleave=interleave, clamp=clamp)
        if output_format is not None and x.numel():
            return from_cast_parts(swiglu_kernels.swiglu_forward_fp8_triton(
                x, *output_format.cast_args(), **layout), x.dtype)
        return swiglu_kernels.swiglu_forward_triton(x, **layout)
    swiglu_kernels.check_halves(x, kind, interleave)
    return _glu_value(kind, x, interleave, clamp).to(x.dtype)


def _halves(x: Tensor, interleave: int) -> tuple:
    """``(a, b)`` in the compute dtype."""
    return _deinterleave(x.to(compute_dtype(x.dtype)), interleave).chunk(2, -1)


def _glu_value(kind: str, x: Tensor, interleave: int, clamp: tuple) -> Tensor:
    """``gate(a) * linear(b)`` in the compute dtype (PyTorch ops)."""
    a, b = _halves(x, interleave)
    if kind == "clamped_swiglu":
        gate, _, linear = _clamped(a, b, clamp)
        return gate * linear
    if kind == "situ_glu":
        gate, _, linear, _ = _situ(a, b, clamp)
        return gate * linear
    return GATES[kind][0](a) * b


def _glu_input_grad(kind: str, dy: Tensor, x: Tensor, interleave: int, clamp: tuple) -> Tensor:
    """The gradient w.r.t. ``x`` (in the compute dtype, ``x``'s layout) of the unit's
    value, for ``dy`` in the compute dtype (PyTorch ops)."""
    a, b = _halves(x, interleave)
    if kind == "clamped_swiglu":
        limit = clamp[0]
        gate, gate_grad, linear = _clamped(a, b, clamp)
        da = torch.where(a <= limit, dy * linear * gate_grad, 0.0)
        db = torch.where((b >= -limit) & (b <= limit), dy * gate, 0.0)
    elif kind == "situ_glu":
        gate, gate_grad, linear, linear_grad = _situ(a, b, clamp)
        da, db = dy * linear * gate_grad, dy * gate * linear_grad
    else:
        gate, gate_backward = GATES[kind]
        da, db = gate_backward(dy * b, a), dy * gate(a)
    return _interleave(torch.cat([da, db], -1), interleave)


def scaled_glu_forward(kind: str, x: Tensor, scales: Tensor, interleave: int = 0,
                       clamp: tuple = CLAMP_DEFAULTS,
                       output_format: Optional[Float8Format] = None):
    """``glu(x) * scales[..., None]`` (``scales``: ``x.shape[:-1]``, a mixture of experts'
    router weights), computed in float32 for 16-bit inputs and rounded once. On CUDA one
    Triton kernel (with ``output_format``, the result as that Float8Tensor, never written
    in high precision); elsewhere PyTorch ops and a high-precision result."""
    if triton_can_run(x, scales):
        layout = _Layout(kind=kind, interleave=interleave, clamp=clamp)
        if output_format is not None and x.numel():
            return from_cast_parts(scaled_kernels.scaled_glu_forward_triton(
                x, scales, output_format.cast_args(), **layout), x.dtype)
        return scaled_kernels.scaled_glu_forward_triton(x, scales, **layout)
    swiglu_kernels.check_halves(x, kind, interleave)
    value = _glu_value(kind, x, interleave, clamp)
    return (value * scales.to(value.dtype).unsqueeze(-1)).to(x.dtype)


def scaled_glu_backward(kind: str, grad_output: Tensor, x: Tensor, scales: Tensor,
                        need_grad_input: bool, need_grad_scales: bool, interleave: int = 0,
                        clamp: tuple = CLAMP_DEFAULTS,
                        output_format: Optional[Float8Format] = None) -> tuple:
    """``(dx, dscales)`` of :func:`scaled_glu_forward` (None where not needed):
    ``dx = glu'(x)(dy * s)``, ``dscales = sum(dy * glu(x), -1)``, each rounded once to
    ``x``'s dtype (the scales': the op requires both the same). ``scales`` may be None
    where ``dx`` is not needed. On CUDA one Triton kernel (``output_format``: ``dx`` as
    that Float8Tensor; the sum in float32 in column order), elsewhere PyTorch ops."""
    if triton_can_run(grad_output, x) and (scales is None or triton_can_run(scales)):
        layout = _Layout(kind=kind, interleave=interleave, clamp=clamp)
        s = scales if scales is not None else x.new_empty(x.shape[:-1])  # unread
        fmt = output_format.cast_args() if output_format is not None and x.numel() else None
        dx, ds = scaled_kernels.scaled_glu_backward_triton(
            grad_output, x, s, need_grad_input, need_grad_scales, fmt, **layout)
        if fmt is not None and dx is not None:
            dx = from_cast_parts(dx, grad_output.dtype)
        return dx, ds
    dy = grad_output.to(compute_dtype(x.dtype))
    dx = ds = None
    if need_grad_input:
        dys = dy * scales.to(dy.dtype).unsqueeze(-1)
        dx = _glu_input_grad(kind, dys, x, interleave, clamp).to(x.dtype)
    if need_grad_scales:
        ds = (dy * _glu_value(kind, x, interleave, clamp)).sum(-1).to(x.dtype)
    return dx, ds


def glu_backward(kind: str, grad_output: Tensor, x: Tensor,
                 output_format: Optional[Float8Format] = None, interleave: int = 0,
                 clamp: tuple = CLAMP_DEFAULTS):
    """The gradient of :func:`glu_forward` w.r.t. ``x``; ``output_format``, ``interleave``,
    ``clamp`` and the devices as there."""
    if triton_can_run(grad_output, x):
        layout = _Layout(kind=kind, interleave=interleave, clamp=clamp)
        if output_format is not None and x.numel():
            return from_cast_parts(swiglu_kernels.swiglu_backward_fp8_triton(
                grad_output, x, *output_format.cast_args(), **layout), grad_output.dtype)
        return swiglu_kernels.swiglu_backward_triton(grad_output, x, **layout)
    swiglu_kernels.check_halves(x, kind, interleave)
    dy = grad_output.to(compute_dtype(x.dtype))
    return _glu_input_grad(kind, dy, x, interleave, clamp).to(x.dtype)


def glu_backward_with_output(kind: str, grad_output: Tensor, x: Tensor, interleave: int = 0,
                             clamp: tuple = CLAMP_DEFAULTS, consume_grad: bool = False,
                             consume_input: bool = False) -> tuple:
    """A gated unit's input gradient and its forward result again, bit for bit (for a
    weight gradient that recomputes its input instead of saving it:
    ``fusions/recompute_glu_linear.py``).

    On CUDA one Triton kernel, which writes ``y`` from the reads the gradient makes;
    elsewhere the PyTorch ops.

    Parameters
    ----------
    kind : str
        The unit (``op.kind``).
    grad_output : Tensor
        The gradient of the unit's output.
    x : Tensor
        The unit's input, as the forward read it.
    interleave, clamp
        As in :func:`glu_forward`.
    consume_grad : bool
        The caller reads ``grad_output`` no more: on CUDA ``y`` may be written over it
        (one tensor of its size less alive at once).
    consume_input : bool
        Nothing reads ``x`` afterwards: ``dx`` is written over it where it is contiguous
        and of the gradient's dtype (on CUDA in the kernel, one tensor of ``x``'s size less
        alive at once; elsewhere copied, so that every device aliases alike).

    Returns
    -------
    tuple
        ``(dx, y)``: ``dx`` as :func:`glu_backward` gives it, ``y`` as :func:`glu_forward`.
    """
    # written over a plain contiguous input of the gradient's dtype only, on every device
    over_x = (consume_input and type(x) is torch.Tensor and x.is_contiguous()
              and grad_output.dtype == x.dtype)
    if triton_can_run(grad_output, x):
        dx, y = swiglu_kernels.swiglu_backward_triton(grad_output, x, kind=kind,
                                                      interleave=interleave, clamp=clamp,
                                                      with_output=True,
                                                      consume_grad=consume_grad,
                                                      consume_input=over_x)
        if dx is x:  # as an in-place op would: a reader of x's old values would raise
            torch.autograd.graph.increment_version(x)
        return dx, y
    y = glu_forward(kind, x, None, interleave, clamp)
    dx = glu_backward(kind, grad_output, x, None, interleave, clamp)
    return (x.copy_(dx) if over_x else dx), y


def _clamped(a: Tensor, b: Tensor, clamp: tuple) -> tuple:
    """The clamped SwiGLU's ``(gate(a'), gate'(a'), b' + offset)``."""
    limit, alpha, offset = clamp
    a, b = a.clamp(max=limit), b.clamp(-limit, limit)
    sig = torch.sigmoid(alpha * a)
    return a * sig, sig + alpha * a * sig * (1 - sig), b + offset


def _situ(a: Tensor, b: Tensor, params: tuple) -> tuple:
    """SiTU-GLU's ``(gate(a), gate'(a), linear(b), linear'(b))`` for ``params = (gate
    scale s, linear scale l, offset)``: ``gate(a) = s tanh(a/s) sigmoid(a)``, ``linear(b)
    = l tanh(b/l) + offset`` (``b + offset`` for ``l = 0``)."""
    gate_scale, linear_scale, offset = params
    z, sig = a / gate_scale, torch.sigmoid(a)
    gate = gate_scale * torch.tanh(z) * sig
    gate_grad = _tanh_grad(z) * sig + gate * torch.sigmoid(-a)
    if not linear_scale:
        return gate, gate_grad, b + offset, torch.ones_like(b)
    w = b / linear_scale
    return gate, gate_grad, linear_scale * torch.tanh(w) + offset, _tanh_grad(w)


def _tanh_grad(z: Tensor) -> Tensor:
    """1 - tanh(z)^2 as 4 sigmoid(2z) sigmoid(-2z): no cancellation where tanh saturates."""
    return 4 * torch.sigmoid(2 * z) * torch.sigmoid(-2 * z)


def _deinterleave(x: Tensor, interleave: int) -> Tensor:
    """``x`` with halves alternating in blocks of ``interleave`` as ``[a | b]``."""
    if not interleave or not x.numel():
        return x
    width = x.shape[-1]
    return x.reshape(-1, width // (2 * interleave), 2, interleave).transpose(1, 2).reshape(
        x.shape)


def _interleave(dx: Tensor, interleave: int) -> Tensor:
    """The inverse of :func:`_deinterleave`."""
    if not interleave or not dx.numel():
        return dx
    width = dx.shape[-1]
    return dx.reshape(-1, 2, width // (2 * interleave), interleave).transpose(1, 2).reshape(
        dx.shape)


def swiglu_forward(x: Tensor, output_format: Optional[Float8Format] = None):
    """:func:`glu_forward` of SwiGLU: ``silu(a) * b``."""
    return glu_forward("swiglu", x, output_format)


def swiglu_backward(grad_output: Tensor, x: Tensor,
                    output_format: Optional[Float8Format] = None):
    """:func:`glu_backward` of SwiGLU."""
    return glu_backward("swiglu", grad_output, x, output_format)
