"""The documented plugin example works as a plugin: registered, planned, correct."""

import importlib.util
import pathlib

import pytest

from fusible import ops
from fusible.testing import check_fusion, exact_parameters_, exact_tensor

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "plugin_fusion.py"


@pytest.fixture
def plugin(plugins):
    """The example's fusion, registered by running the example (undone after the test)."""
    spec = importlib.util.spec_from_file_location("plugin_fusion", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ForwardScaleBias


def test_plugin_fusion_is_chosen_and_correct(plugin, dtype):
    model = exact_parameters_(ops.Sequential(ops.BasicLinear(8, 16), ops.ConstantScale(0.5),
                                             ops.Bias(16)).to(dtype))
    x = exact_tensor((3, 8), dtype).requires_grad_()
    check_fusion(model, x, forward=["ForwardScaleBias"])
    # ForwardLinearBias cannot apply (ConstantScale sits between); BackwardLinearBias cannot either.
    assert [s.name for s in model.plan(x).forward] == ["BasicLinear", "ForwardScaleBias"]

