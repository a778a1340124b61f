"""Checks for fusible and for plugin authors: outputs and gradients against FP64
references, the fusions a plan chose, compiled against eager bit for bit, the split
backward against the one-lane backward bit for bit, and ``torch.library.opcheck`` of every
stage's custom op."""

from __future__ import annotations

import threading
from typing import Iterable

import torch

from fusible.core.lanes import split_backward
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.runtime import custom_ops, deferred, wgrad
from fusible.testing.reference import Rounding, exact_tensor, reference_copy, reference_forward

# Relative tolerance against an FP64 reference, per dtype of the computation.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 1e-3,
             torch.bfloat16: 8e-3}
# Compared as bytes (E8M0: MX scales): the CPU has no equality kernels for them.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
_GRAD_STREAM = 0x9E3779B9  # the output gradients' seed is this XOR the caller's


def assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype,
                 what: str = "tensor", scale: float = 1.0) -> None:
    """``|a - r| <= tol * (|r| + rms(r))`` elementwise, tol = ``scale * TOLERANCE[dtype]``.

    The tolerances are about two units in the last place of each 16-bit dtype: against a
    reference rounded where the stages round (:func:`check_against_reference`) they fit
    chains of any length, and ``scale`` is for comparisons with an unrounded reference.
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


# How much wider the 16-bit tolerances are for a model with an op that rounds within its
# stage: Attention's probabilities rounded to bfloat16 before the second GEMM move its
# gradients by up to two of the dtype's rounding steps beyond the reference's.
ROUNDS_WITHIN_SCALE = 4.0


def check_against_reference(model, x, *extra_inputs, seed: int = 0,
                            tolerance_scale: float = 1.0, strict: bool = False) -> None:
    """Compare outputs and all gradients of ``model(x, *extra_inputs)`` with FP64.

    The reference computes each stage of the model's plan in float64 and rounds its
    results to the model's dtype where the stage writes them (:class:`Rounding`): what a
    correct stage computes, in a chain of any length. Gradients are checked for the
    input, the extra inputs and the parameters that require grad (their ``.grad`` is reset
    first). Inputs and parameters need not be exactly representable: the reference starts
    from the same values.

    ``strict`` (16-bit dtypes): also require the results to equal the rounded reference
    almost everywhere (at most 1% of the values a rounding apart), which a stage computing
    in 16 bits where it should compute in float32 fails. Single ops meet it; fusions that
    round at other points than their stage's end (a GEMM epilogue followed by an add) may
    not. An op that declares roundings within its stage (``rounds_within``: Attention)
    widens the 16-bit tolerances by :data:`ROUNDS_WITHIN_SCALE` and is exempt from
    ``strict``: the reference rounds only at the stage's end.
    """
    dtype = x.dtype
    inputs = (x, *extra_inputs)
    plan = model.plan(*inputs)
    if dtype in (torch.bfloat16, torch.float16) and \
            any(getattr(op, "rounds_within", "") for op in plan.ops):
        tolerance_scale, strict = tolerance_scale * ROUNDS_WITHIN_SCALE, False
    for t in (*inputs, *model.parameters()):
        t.grad = None
    copies: dict = {}  # one copy per distinct input, so that model(x, x) stays aliased
    for t in inputs:
        copies.setdefault(id(t), reference_copy(t))
    ref_inputs = [copies[id(t)] for t in inputs]
    rounding = Rounding.of_plan(plan, dtype) if dtype != torch.float64 else None
    outputs = _as_tuple(model(*inputs))
    ref_outputs, ref_params = reference_forward(model, *ref_inputs, rounding=rounding)
    ref_outputs = _as_tuple(ref_outputs)
    if len(outputs) != len(ref_outputs):
        raise AssertionError(f"the model returned {len(outputs)} outputs, the reference "
                             f"{len(ref_outputs)}")
    # Output gradients from another stream than ``seed``'s: drawn from the generator that
    # drew the input they would equal it, and for a scale-invariant op (L2Normalization)
    # the true input gradient is then zero, all rounding noise.
    gen = torch.Generator().manual_seed(_GRAD_STREAM ^ seed)
    grads = [exact_tensor(o.shape, dtype, device=o.device, generator=gen) for o in outputs]
    pairs = [(f"output {i}", out, ref) for i, (out, ref) in enumerate(zip(outputs, ref_outputs))]
    if any(o.requires_grad for o in outputs):
        torch.autograd.backward([o for o in outputs if o.requires_grad],
                                [g for o, g in zip(outputs, grads) if o.requires_grad])
        torch.autograd.backward([o for o in ref_outputs if o.requires_grad],
                                [g.double() for o, g in zip(ref_outputs, grads)
                                 if o.requires_grad])
        pairs += [(f"gradient of input {i}", t.grad, r.grad)
                  for i, (t, r) in enumerate(zip(inputs, ref_inputs)) if t.requires_grad]
        pairs += [(f"gradient of {name}", p.grad, ref_params[id(p)].grad)
                  for name, p in model.named_parameters() if p.requires_grad]
    for what, got, want in pairs:
        assert_close(got, want, dtype, what, tolerance_scale)
        if strict and dtype in (torch.bfloat16, torch.float16):
            assert_rounded_equal(got, want, dtype, what)


def assert_rounded_equal(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype,
                         what: str = "tensor", max_mismatch: float = 0.01) -> None:
    """At most ``max_mismatch`` of the values differ from ``reference`` rounded to ``dtype``
    (a stage that computes in float32 and rounds once matches it almost everywhere)."""
    got = actual.detach().cpu().to(dtype)
    want = reference.detach().cpu().to(dtype)
    share = (got != want).double().mean().item() if got.numel() else 0.0
    if share > max_mismatch:
        raise AssertionError(f"{what} ({dtype}): {share:.1%} of the values differ from the "
                             f"reference rounded once (at most {max_mismatch:.0%} may): the "
                             f"stage computes in lower precision than float32, or rounds more "
                             f"often than once")


def stage_names(stages: Iterable) -> list:
    """The ``name`` of each stage."""
    return [s.name for s in stages]


def check_fusion(model, x, *extra_inputs, forward: Iterable = (), backward: Iterable = (),
                 tolerance_scale: float = 1.0, compiled: bool = True,
                 strict: bool = False) -> None:
    """Assert that the plan contains the named fusions, then check numerics, the compiled
    path and the custom ops.

    Parameters
    ----------
    model : fusible.ops.Sequential
    x, *extra_inputs : Tensor
        Exactly representable inputs.
    forward, backward : iterable of str
        Fusion names that must appear among the forward / backward stages.
    tolerance_scale : float
        Passed to :func:`assert_close`.
    strict : bool
        Passed to :func:`check_against_reference`.
    compiled : bool
        Also check ``torch.compile(model, fullgraph=True)`` against eager, bit for bit
        (:func:`check_compiled_matches_eager`), and opcheck every stage's custom op
        (:func:`opcheck_stages`). Both reset dynamo's caches first.
    """
    plan = model.plan(x, *extra_inputs)
    for direction, expected, stages in (("forward", forward, plan.forward),
                                        ("backward", backward, plan.backward)):
        missing = [name for name in expected if name not in stage_names(stages)]
        if missing:
            raise AssertionError(f"{direction} plan lacks {missing}:\n{plan.explain()}")
    check_against_reference(model, x, *extra_inputs, tolerance_scale=tolerance_scale,
                            strict=strict)
    if compiled:
        check_compiled_matches_eager(model, x, *extra_inputs)
        opcheck_stages(model, x, *extra_inputs)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _outputs_and_grads(fn, model, inputs, grads_out, deferred_wgrads: bool = False) -> list:
    """Outputs of ``fn(*inputs)``, then (after a backward with ``grads_out``, and the
    deferred wgrads run one by one, the last queued first) the gradients of the inputs and
    parameters that require grad."""
    for t in (*inputs, *model.parameters()):
        t.grad = None
    outputs = _as_tuple(fn(*inputs))
    outs = [o for o in outputs if o.requires_grad]
    if outs:
        torch.autograd.backward(outs, [g for o, g in zip(outputs, grads_out) if o.requires_grad])
    if deferred_wgrads:
        wgrad.run_entries(reversed(deferred.drain(threading.get_ident())))
    grads = [t.grad for t in (*inputs, *model.parameters()) if t.requires_grad]
    return [o.detach() for o in outputs] + grads


def check_compiled_matches_eager(model, x, *extra_inputs, backend: str = "aot_eager") -> None:
    """``torch.compile(model, fullgraph=True)`` computes the outputs and every gradient
    of eager mode bit for bit (resets dynamo's caches first)."""
    torch._dynamo.reset()
    inputs = (x, *extra_inputs)
    grads_out = _output_grads(model, inputs)
    eager = _outputs_and_grads(model, model, inputs, grads_out)
    compiled = _outputs_and_grads(torch.compile(model, fullgraph=True, backend=backend), model,
                                  inputs, grads_out)
    _assert_same_bits(compiled, eager, f"compiled ({backend}) differs from eager")
    torch._dynamo.reset()


def _output_grads(model, inputs) -> list:
    """Exactly representable gradients for each of the model's outputs on ``inputs``."""
    outputs = _as_tuple(model(*inputs))
    gen = torch.Generator().manual_seed(1)
    return [exact_tensor(o.shape, o.dtype, device=o.device, generator=gen) for o in outputs]


def _assert_same_bits(got: list, want: list, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        if not same_bits(a, b):
            raise AssertionError(f"{what} in result {i} (outputs, then gradients of inputs "
                                 f"and parameters)")


def check_split_matches_unsplit(model, x, *extra_inputs, backend: "str | None" = None) -> None:
    """Under :func:`fusible.split_backward` (the deferred wgrads run after the backward, in
    reverse order) the outputs and every gradient are bit for bit those of the one-lane
    backward, under the autocast state in effect; ``backend``: compile the split run
    (``fullgraph=True``). The split plan must be made: a stage that cannot split keeps
    its wgrad with its dgrad."""
    inputs = (x, *extra_inputs)
    grads_out = _output_grads(model, inputs)
    one_lane = _outputs_and_grads(model, model, inputs, grads_out)
    fn = model if backend is None else torch.compile(model, fullgraph=True, backend=backend)

    def split(*args):
        with split_backward():
            return fn(*args)

    got = _outputs_and_grads(split, model, inputs, grads_out, deferred_wgrads=True)
    _assert_same_bits(got, one_lane, "the split backward differs from the one-lane backward")


def same_bits(a, b) -> bool:
    """Whether two results are equal bit for bit (Float8Tensors: data and scale; two
    Nones, such as gradients not computed, are equal)."""
    if a is None or b is None:
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, Float8Tensor):
        return same_bits(a._data, b._data) and same_bits(a._scale_inv, b._scale_inv)
    if a.dtype in FP8_DTYPES:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


def recorded_stage_calls(fn, *args) -> dict:
    """Run ``fn(*args)`` compiled (dynamo only, so that the stages' custom ops run on
    real tensors), with a backward of its outputs that require grad; returns
    ``{op name: (overload, flat args)}``, the first call of each op."""
    torch._dynamo.reset()
    custom_ops.recorder = []
    try:
        outputs = _as_tuple(torch.compile(fn, fullgraph=True, backend="eager")(*args))
        outs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        calls: dict[str, tuple] = {}
        for overload, flat in custom_ops.recorder:
            if not any(isinstance(a, torch._subclasses.FakeTensor) for a in flat):
                calls.setdefault(str(overload), (overload, flat))
        return calls
    finally:
        custom_ops.recorder = None
        torch._dynamo.reset()


def opcheck(overload, args) -> None:
    """``torch.library.opcheck`` of one stage-op call (FP8 inputs: the tests CPU supports,
    and a bitwise check that no input is mutated)."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    fp8_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES]
    if not fp8_inputs:
        torch.library.opcheck(overload, args)
        return
    # opcheck's schema test compares inputs with allclose, which CPU lacks for FP8 dtypes.
    torch.library.opcheck(overload, args, test_utils=(
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    before = [a.view(torch.uint8).clone() for a in fp8_inputs]
    overload(*args)
    if not all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8_inputs, before)):
        raise AssertionError(f"{overload} mutated an FP8 input")


def opcheck_stages(model, x, *extra_inputs) -> None:
    """opcheck every stage custom op that ``model(x, *extra_inputs)`` runs, on the
    arguments of a real run."""
    for overload, args in recorded_stage_calls(model, x, *extra_inputs).values():
        opcheck(overload, args)
