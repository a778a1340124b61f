"""torch.library.opcheck for every fusible custom op, on inputs recorded from real runs."""

import pytest
import torch

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
        calls = {}
        for overload, args in custom_ops.recorder:
            calls.setdefault(str(overload), (overload, args))
        return calls
    finally:
        custom_ops.recorder = None
        torch._dynamo.reset()


CALLS = _recorded_calls()


def test_every_builtin_stage_was_recorded():
    names = {name.split(".")[1] for name in CALLS}
    expected = {"ForwardLinearBias_fwd", "ForwardLinearBiasActivation_fwd",
                "ForwardLinearBiasAdd_fwd", "BackwardLinearBias_bwd", "BackwardActivationBias_bwd",
                "BackwardLinearAdd_bwd", "LayerNorm_fwd", "LayerNorm_bwd", "RMSNorm_fwd",
                "RMSNorm_bwd", "SwiGLU_fwd", "SwiGLU_bwd", "Reshape_fwd", "Reshape_bwd"}
    assert expected <= names, expected - names


@pytest.mark.parametrize("name", sorted(CALLS))
def test_opcheck(name):
    overload, args = CALLS[name]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(overload, args)
