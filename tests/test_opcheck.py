"""torch.library.opcheck for every fusible custom op, on inputs recorded from real runs."""

import pytest
import torch

import fusible
from fusible import custom_ops, ops
from compile_models import MODELS, inputs, outputs_of


def _recorded_calls():
    """Run every model, training and inference, with dynamo but without AOTAutograd,
    so that the custom ops run on real tensors; keep the first call of each op."""
    torch._dynamo.reset()
    custom_ops.recorder = []
    try:
        for name, factory in MODELS.items():
            torch._dynamo.reset()  # each instance compiles its own graph (guards on identity)
            model, num_extra = factory()
            compiled = torch.compile(model, fullgraph=True, backend="eager")
            x, extras = inputs(num_extra)
            sum(o.sum() for o in outputs_of(compiled(x, *extras))).backward()
            with torch.no_grad():
                compiled(x, *extras)
        inference = ops.Sequential(ops.BasicLinear(8, 16), ops.Bias(16), ops.GELU())
        with torch.no_grad():
            torch.compile(inference, fullgraph=True, backend="eager")(torch.randn(3, 8))
        _record_fp8_runs()
        calls = {}
        for overload, args in custom_ops.recorder:
            if isinstance(args[0], torch._subclasses.FakeTensor):
                continue  # dynamo's tracing: keep the real runs
            fp8 = args[-2]
            calls.setdefault(f"{overload}{' fp8' if fp8 else ''}", (overload, args))
        return calls
    finally:
        custom_ops.recorder = None
        torch._dynamo.reset()


def _record_fp8_runs():
    torch._dynamo.reset()
    model = ops.Sequential(ops.MakeExtraOutput(), ops.Linear(32, 64), ops.GELU(),
                           ops.Linear(64, 32), ops.AddExtraInput(), ops.Quantize(backward=True))
    x = torch.randn(16, 32, requires_grad=True)
    with fusible.autocast():
        y, branch = torch.compile(model, fullgraph=True, backend="eager")(x, x)
    (y.dequantize().sum() + branch.sum()).backward()


CALLS = _recorded_calls()


def test_every_builtin_stage_was_recorded():
    names = {name.split(".")[1] for name in CALLS}
    expected = {"ForwardLinearBias_fwd", "ForwardLinearBiasActivation_fwd",
                "ForwardLinearBiasAdd_fwd", "BackwardLinearBias_bwd", "BackwardActivationBias_bwd",
                "BackwardLinearAdd_bwd", "LayerNorm_fwd", "LayerNorm_bwd", "RMSNorm_fwd",
                "RMSNorm_bwd", "SwiGLU_fwd", "SwiGLU_bwd", "Reshape_fwd", "Reshape_bwd"}
    assert expected <= names, expected - names


def test_fp8_variants_were_recorded():
    fp8 = {name for name in CALLS if name.endswith(" fp8")}
    assert {"fusible.ForwardLinearBias_fwd.default fp8", "fusible.BackwardLinearAdd_bwd.default fp8",
            "fusible.Quantize_fwd.default fp8", "fusible.Quantize_bwd.default fp8"} <= fp8, fp8


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_opcheck(name):
    overload, args = CALLS[name]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    fp8_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES]
    if not fp8_inputs:
        torch.library.opcheck(overload, args)
        return
    # opcheck's schema test compares inputs with allclose, which CPU lacks for FP8 dtypes:
    # run the other tests, and check that no input is mutated bit for bit here.
    torch.library.opcheck(overload, args, test_utils=(
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    before = [a.view(torch.uint8).clone() for a in fp8_inputs]
    overload(*args)
    assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8_inputs, before))
