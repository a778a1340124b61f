"""Norm and activation classes of real model code recognised by what they compute
(fusible.models.probed_modules): each becomes the fusible op computing the same, holding
the module's own parameters; a look-alike computing otherwise stays."""

import copy

import pytest
import torch
from torch import nn

import fusible
from fusible import ops

transformers = pytest.importorskip("transformers")


def _norm_cases():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return [("llama", lambda: LlamaRMSNorm(16, eps=1e-6), ops.RMSNorm, False),
            ("gemma", lambda: GemmaRMSNorm(16, eps=1e-6), ops.RMSNorm, True)]


class _ScaledOnly(nn.Module):
    """Looks like a norm (a weight and an eps), computes ``x * weight``."""

    def __init__(self):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(16)), 1e-6

    def forward(self, x):
        return x * self.weight


@pytest.mark.parametrize("name,make,op,zero_centered", _norm_cases(),
                         ids=[c[0] for c in _norm_cases()])
def test_norm_classes_become_the_op_computing_the_same(name, make, op, zero_centered):
    torch.manual_seed(0)
    model = nn.ModuleDict({"norm": make()})
    with torch.no_grad():
        model["norm"].weight.uniform_(-0.5, 0.5)
    twin, weight = copy.deepcopy(model), model["norm"].weight
    report = fusible.convert(model)
    new = model["norm"]
    assert isinstance(new, op) and new.zero_centered_gamma == zero_centered
    assert new.weight is weight  # the same parameter object
    assert "recognised by computation: within 1e-05" in report.converted[0][2]
    x = torch.randn(3, 16, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    torch.testing.assert_close(new(x), twin["norm"](x_twin), atol=1e-6, rtol=1e-5)
    new(x).sum().backward()
    twin["norm"](x_twin).sum().backward()
    torch.testing.assert_close(weight.grad, twin["norm"].weight.grad, atol=1e-5, rtol=1e-5)


def test_activation_classes_become_their_ops():
    from transformers.activations import GELUActivation, NewGELUActivation, SiLUActivation
    model = nn.ModuleDict({"silu": SiLUActivation(), "gelu": GELUActivation(),
                           "tanh": NewGELUActivation()})
    fusible.convert(model)
    assert isinstance(model["silu"], ops.SiLU)
    assert isinstance(model["gelu"], ops.GELU) and model["gelu"].approximate == "none"
    assert isinstance(model["tanh"], ops.GELU) and model["tanh"].approximate == "tanh"


def test_a_look_alike_computing_otherwise_stays():
    model = nn.ModuleDict({"norm": _ScaledOnly()})
    report = fusible.convert(model)
    assert isinstance(model["norm"], _ScaledOnly)
    assert report.left[0][:2] == ("norm", "_ScaledOnly")
