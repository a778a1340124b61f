"""Testing helpers for fusible and for plugin authors.

* :func:`exact_tensor` draws values every float dtype represents exactly, so
  that an FP64 reference sees the very inputs the op under test saw.
* :func:`reference_forward` runs any Sequential with plain differentiable
  PyTorch in float64, op by op, from the table of reference implementations
  (extend it for your own ops with :func:`register_reference`).
* :func:`check_against_reference` compares outputs and every gradient with
  that reference; :func:`check_fusion` also asserts which fusions the plan chose.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fusible import ops

_REFERENCES: dict = {}

# Relative tolerance against an FP64 reference, per dtype of the computation.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 1e-3,
             torch.bfloat16: 8e-3}


def register_reference(op_type: type) -> Callable:
    """Decorator registering ``fn(op, x, extra_inputs, params) -> (y, extra_outputs)``.

    ``params`` are float64 copies of ``op.fusible_params()``, in that order.
    """
    def decorator(fn):
        _REFERENCES[op_type] = fn
        return fn
    return decorator


def _ref(op_type):
    return register_reference(op_type)


_ref(ops.BasicLinear)(lambda op, x, e, p: (F.linear(x, p[0]), ()))
_ref(ops.Bias)(lambda op, x, e, p: (x + p[0], ()))
_ref(ops.GELU)(lambda op, x, e, p: (F.gelu(x, approximate=op.approximate), ()))
_ref(ops.ReLU)(lambda op, x, e, p: (F.relu(x), ()))
_ref(ops.SiLU)(lambda op, x, e, p: (F.silu(x), ()))
_ref(ops.SwiGLU)(lambda op, x, e, p: (F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], ()))
_ref(ops.Identity)(lambda op, x, e, p: (x, ()))
_ref(ops.Quantize)(lambda op, x, e, p: (x, ()))  # the reference does not quantize
_ref(ops.Reshape)(lambda op, x, e, p: (x.reshape(op.shape), ()))
_ref(ops.ConstantScale)(lambda op, x, e, p: (x * op.scale, ()))
_ref(ops.AddExtraInput)(lambda op, x, e, p: (x + e[0], ()))
_ref(ops.MakeExtraOutput)(lambda op, x, e, p: (x, (x,)))
_ref(ops.LayerNorm)(lambda op, x, e, p: (F.layer_norm(x, op.normalized_shape, p[0], p[1],
                                                      op.eps), ()))


@_ref(ops.RMSNorm)
def _rms_norm(op, x, e, p):
    dims = tuple(range(-len(op.normalized_shape), 0))
    return x * torch.rsqrt(x.square().mean(dims, keepdim=True) + op.eps) * p[0], ()


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


def reference_forward(model, x, *extra_inputs, dtype=torch.float64):
    """Run ``model`` op by op with plain PyTorch in ``dtype``.

    Returns ``(outputs, params)``: outputs as the model would return them and
    a dict mapping each original parameter (by id) to its differentiable copy.
    """
    params: dict = {}

    def copy_of(p):
        if id(p) not in params:
            params[id(p)] = p.detach().to(dtype).requires_grad_(p.requires_grad)
        return params[id(p)]

    extras, extra_outputs = list(extra_inputs), []
    for item in model.pipeline():
        if isinstance(item, ops.BasicOperation):
            fn = _REFERENCES.get(type(item))
            if fn is None:
                raise KeyError(f"no reference for {type(item).__name__}; add one with "
                               f"fusible.testing.register_reference")
            k = item.num_extra_inputs
            x, outs = fn(item, x, extras[:k], [copy_of(p) for p in item.fusible_params()])
            extras = extras[k:]
            extra_outputs += outs
        else:  # an ordinary module: run it on float64 copies of its parameters and buffers
            state = {name: copy_of(p) for name, p in item.named_parameters()}
            state.update({name: b.to(dtype) if b.is_floating_point() else b
                          for name, b in item.named_buffers()})
            x = torch.func.functional_call(item, state, (x,))
    return ((x, *extra_outputs) if extra_outputs else x), params


def assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype,
                 what: str = "tensor", scale: float = 1.0) -> None:
    """``|a - r| <= tol * (|r| + rms(r))`` elementwise, tol = ``scale * TOLERANCE[dtype]``.

    The tolerances fit one op or one fusion; a chain of several ops in a 16-bit
    dtype rounds every intermediate, and needs ``scale`` > 1 (about 4 for a
    transformer MLP block in bfloat16).
    """
    if actual is None or reference is None:
        raise AssertionError(f"{what}: got {actual!r}, reference {reference!r}")
    a, r = actual.detach().double().cpu(), reference.detach().double().cpu()
    if a.shape != r.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != reference {tuple(r.shape)}")
    tol = TOLERANCE[dtype] * scale
    bound = tol * (r.abs() + r.square().mean().sqrt())
    err = (a - r).abs()
    if not bool((err <= bound).all()):
        worst = int((err - bound).argmax())
        raise AssertionError(f"{what} ({dtype}): max error {err.max().item():.3g}, at flat index "
                             f"{worst} got {a.flatten()[worst].item()} vs reference "
                             f"{r.flatten()[worst].item()} (tolerance {tol})")


def check_against_reference(model, x, *extra_inputs, seed: int = 0,
                            tolerance_scale: float = 1.0) -> None:
    """Compare outputs and all gradients of ``model(x, *extra_inputs)`` with FP64.

    Gradients are checked for the input, the extra inputs and the parameters
    that require grad (their ``.grad`` is reset first). Use exactly representable
    inputs and parameters.
    """
    dtype = x.dtype
    inputs = (x, *extra_inputs)
    for t in (*inputs, *model.parameters()):
        t.grad = None
    copies: dict = {}  # one copy per distinct input, so that model(x, x) stays aliased
    for t in inputs:
        copies.setdefault(id(t), t.detach().double().requires_grad_(t.requires_grad))
    ref_inputs = [copies[id(t)] for t in inputs]
    outputs = _as_tuple(model(*inputs))
    ref_outputs, ref_params = reference_forward(model, *ref_inputs)
    ref_outputs = _as_tuple(ref_outputs)
    if len(outputs) != len(ref_outputs):
        raise AssertionError(f"the model returned {len(outputs)} outputs, the reference "
                             f"{len(ref_outputs)}")
    gen = torch.Generator().manual_seed(seed)
    grads = [exact_tensor(o.shape, dtype, device=o.device, generator=gen) for o in outputs]
    for i, (out, ref) in enumerate(zip(outputs, ref_outputs)):
        assert_close(out, ref, dtype, f"output {i}", tolerance_scale)
    if not any(o.requires_grad for o in outputs):
        return
    torch.autograd.backward([o for o in outputs if o.requires_grad],
                            [g for o, g in zip(outputs, grads) if o.requires_grad])
    torch.autograd.backward([o for o in ref_outputs if o.requires_grad],
                            [g.double() for o, g in zip(ref_outputs, grads) if o.requires_grad])
    for i, (t, r) in enumerate(zip(inputs, ref_inputs)):
        if t.requires_grad:
            assert_close(t.grad, r.grad, dtype, f"gradient of input {i}", tolerance_scale)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, ref_params[id(p)].grad, dtype, f"gradient of {name}",
                         tolerance_scale)


def stage_names(stages: Iterable) -> list:
    """The ``name`` of each stage."""
    return [s.name for s in stages]


def check_fusion(model, x, *extra_inputs, forward: Iterable = (), backward: Iterable = (),
                 tolerance_scale: float = 1.0) -> None:
    """Assert that the plan contains the named fusions, then check numerics.

    Parameters
    ----------
    model : fusible.ops.Sequential
    x, *extra_inputs : Tensor
        Exactly representable inputs.
    forward, backward : iterable of str
        Fusion names that must appear among the forward / backward stages.
    tolerance_scale : float
        Passed to :func:`assert_close`.
    """
    plan = model.plan(x, *extra_inputs)
    for direction, expected, stages in (("forward", forward, plan.forward),
                                        ("backward", backward, plan.backward)):
        missing = [name for name in expected if name not in stage_names(stages)]
        if missing:
            raise AssertionError(f"{direction} plan lacks {missing}:\n{plan.explain()}")
    check_against_reference(model, x, *extra_inputs, tolerance_scale=tolerance_scale)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


# FP8: signal-to-noise bounds derived from the formats ---------------------------------

# Round-to-nearest with m mantissa bits leaves a relative error uniform in +-2^-(m+1):
# a noise-to-signal power of 2^-2(m+1) / 3 for values spread over a binade, that is an
# SNR of 6.02 (m + 1) + 4.77 dB. E4M3 keeps 3 mantissa bits, E5M2 2.
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def snr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``actual`` against ``reference``, in dB."""
    if isinstance(actual, torch.Tensor) and hasattr(actual, "dequantize") and \
            type(actual) is not torch.Tensor:
        actual = actual.dequantize()
    a, r = actual.detach().double().cpu(), reference.detach().double().cpu()
    noise = (a - r).square().sum()
    return float("inf") if noise == 0 else (10 * torch.log10(r.square().sum() / noise)).item()


def fp8_snr_floor(*fp8_dtypes: torch.dtype, margin_db: float = 3.0) -> float:
    """The SNR a result of operands quantized to ``fp8_dtypes`` should exceed, in dB.

    The operands' quantization noise powers add (a GEMM of an E4M3 and an E5M2
    operand: ``fp8_snr_floor(E4M3, E5M2)``); ``margin_db`` allows for the
    accumulation and the output rounding.
    """
    nsr = sum(10 ** (-(6.02 * (_MANTISSA_BITS[d] + 1) + 4.77) / 10) for d in fp8_dtypes)
    return -10 * torch.log10(torch.tensor(nsr)).item() - margin_db
