"""torch.library.opcheck for the custom ops of multi-op models, on inputs recorded from
real runs (each op and fusion alone is opchecked by tests/test_matrix.py)."""

import pytest
import torch

import fusible
from fusible import ops
from fusible.testing import opcheck, recorded_stage_calls
from compile_models import MODELS, inputs


def _recorded_calls() -> dict:
    """Every model, training and inference, and an FP8 model; the first call of each op
    (FP8 calls under their own key)."""
    calls = {}
    for factory in MODELS.values():
        model, num_extra = factory()
        x, extras = inputs(num_extra)
        calls.update(recorded_stage_calls(model, x, *extras))
        with torch.no_grad():
            calls.update(recorded_stage_calls(model, x.detach(), *extras))
    fp8 = ops.Sequential(ops.MakeExtraOutput(), ops.Linear(32, 64), ops.GELU(),
                         ops.Linear(64, 32), ops.AddExtraInput(), ops.Quantize(backward=True))
    x = torch.randn(16, 32, requires_grad=True)
    with fusible.autocast():
        found = recorded_stage_calls(lambda a, b: _dequantized(fp8(a, b)), x, x)
    calls.update({f"{name} fp8": call for name, call in found.items()})
    return calls


def _dequantized(out):
    y, branch = out
    return y.dequantize(), branch


CALLS = _recorded_calls()


def test_every_builtin_stage_was_recorded():
    names = {name.split(".")[1] for name in CALLS}
    expected = {"ForwardLinearBias_fwd", "ForwardLinearBiasActivation_fwd",
                "ForwardLinearBiasAdd_fwd", "BackwardLinearBias_bwd", "BackwardActivationBias_bwd",
                "BackwardLinearAdd_bwd", "LayerNorm_fwd", "LayerNorm_bwd", "RMSNorm_fwd",
                "RMSNorm_bwd", "SwiGLU_fwd", "SwiGLU_bwd"}
    assert expected <= names, expected - names
    # Stages of aliases and views run inline when compiled: no custom op to check
    assert not names & {"Reshape_fwd", "Reshape_bwd", "Identity_fwd", "Identity_bwd",
                        "MakeExtraOutput_fwd", "AddExtraInput_bwd"}


def test_fp8_variants_were_recorded():
    fp8 = {name for name in CALLS if name.endswith(" fp8")}
    assert {"fusible.ForwardLinearBias_fwd.default fp8", "fusible.BackwardLinearAdd_bwd.default fp8",
            "fusible.Quantize_fwd.default fp8", "fusible.Quantize_bwd.default fp8"} <= fp8, fp8


@pytest.mark.parametrize("name", sorted(CALLS))
def test_opcheck(name):
    opcheck(*CALLS[name])
